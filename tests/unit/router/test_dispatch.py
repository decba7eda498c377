"""The dispatcher over in-memory replicas (tests/replicas_double.py): retry before the
first token elsewhere, resume after a break with no text lost or repeated, deadlines,
the breaker, and a replica's refusal, which is the request's and not the replica's."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, replace
from typing import Any

import pytest

from llmmesh.runtime.errors import InvalidArgument, Unavailable
from llmmesh.types import Chunk, InferenceCall, Sampling
from llmmesh.waiting import poll_until_async
from services.router.breaker import BreakerState
from services.router.config import PoolSettings
from services.router.connector import LoadReport
from services.router.dispatch import RETRIES, Dispatcher
from services.router.endpoints import Endpoint, FixedDiscovery
from services.router.replicas import ReplicaSet
from services.router.routing import PolicyHolder, RoutingPolicy
from services.router.scheduling import Scheduler, SchedulingState
from services.router.scheduling.types import WAITING_BY_PRIORITY, waiting_as_urgent
from services.router.upstreams import RouteHints
from tests.replicas_double import Hang, MemoryConnector, MemoryReplica, expected_text

PROMPT = "Once upon a time"


@dataclass
class Fleet:
    dispatcher: Dispatcher
    replicas: ReplicaSet
    by_address: dict[str, MemoryReplica]
    clock: list[float]  # the replica set's time: [now]

    def __getitem__(self, address: str) -> MemoryReplica:
        return self.by_address[address]


def fleet(addresses: tuple[str, ...] = ("a:1", "b:1"), **settings: Any) -> Fleet:
    """Replicas in memory behind a dispatcher that picks round robin in address order, so
    the first attempt goes to the first replica."""
    connector, clock = MemoryConnector(), [1000.0]
    pool = PoolSettings(breaker_open_s=2.0, **settings)
    replicas = ReplicaSet(
        FixedDiscovery(addresses), connector, pool, "local", clock=lambda: clock[0]
    )
    replicas.apply([Endpoint(address=a) for a in addresses])
    dispatcher = Dispatcher(
        replicas,
        PolicyHolder(RoutingPolicy(algorithm="round_robin")),
        pool,
        Scheduler(SchedulingState("local", rng=random.Random(0))),
    )
    return Fleet(dispatcher, replicas, connector.replicas, clock)


def call(
    max_tokens: int = 20, min_tokens: int = 0, prompt_logprobs: int | None = None
) -> InferenceCall:
    sampling = Sampling(max_tokens, min_tokens=min_tokens, prompt_logprobs=prompt_logprobs)
    return InferenceCall("r1", "llm", PROMPT, sampling)


async def collect(f: Fleet, c: InferenceCall, deadline: float | None = None) -> list[Chunk]:
    return [chunk async for chunk in f.dispatcher.generate(c, RouteHints(deadline=deadline))]


def run(scenario: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(scenario())


def test_a_failure_before_the_first_token_is_retried_on_another_replica() -> None:
    async def scenario() -> None:
        f = fleet()
        f["a:1"].fail_next(0)
        chunks = await collect(f, call())
        assert "".join(c.text for c in chunks) == expected_text(PROMPT, 20)
        assert len(f["a:1"].calls) == 1 and len(f["b:1"].calls) == 1
        assert chunks[-1].route is not None and chunks[-1].route.endpoint == "b:1"
        assert chunks[-1].resumed == 0

    run(scenario)


def test_a_resumed_stream_asks_its_tokens_ids_again_but_not_its_prompts() -> None:
    async def scenario() -> None:
        f = fleet()
        f["a:1"].fail_next(7)
        asked = call(20)
        await collect(f, replace(asked, sampling=replace(asked.sampling, return_token_ids=True)))
        [resumed_call] = f["b:1"].calls
        again = resumed_call.sampling
        assert not again.return_token_ids and again.scores_tokens and again.logprobs == 0

    run(scenario)


def test_a_stream_broken_mid_way_resumes_elsewhere_with_nothing_lost_or_repeated() -> None:
    async def scenario() -> None:
        f = fleet()
        f["a:1"].fail_next(7)
        asked = replace(call(20, min_tokens=10, prompt_logprobs=1), prompt_ids=(1, 2, 3))
        chunks = await collect(f, asked)
        assert "".join(c.text for c in chunks) == expected_text(PROMPT, 20)
        assert sum(c.num_tokens for c in chunks) == 20
        [resumed_call] = f["b:1"].calls
        assert resumed_call.prompt == PROMPT + expected_text(PROMPT, 7)
        assert resumed_call.sampling.max_tokens == 13
        assert resumed_call.sampling.min_tokens == 3
        # the prompt's log probabilities went with the first chunk: not asked again; a
        # prompt of ids goes on as text
        assert resumed_call.sampling.prompt_logprobs is None and resumed_call.prompt_ids == ()
        # what was sent is output still: the engine's penalties count it as such
        assert resumed_call.resumed_output_chars == len(expected_text(PROMPT, 7))
        assert chunks[-1].resumed == 1 and chunks[-1].route is not None
        assert chunks[-1].route.endpoint == "b:1"

    run(scenario)


def test_a_stream_that_keeps_breaking_gives_up_after_its_resumes() -> None:
    async def scenario() -> None:
        f = fleet(("a:1", "b:1", "c:1"), max_resumes=1)
        for replica in ("a:1", "b:1", "c:1"):
            f[replica].fail_next(3)
        with pytest.raises(Unavailable):
            await collect(f, call(20))
        tried = [len(f[r].calls) for r in ("a:1", "b:1", "c:1")]
        assert tried[0] == 1 and sorted(tried) == [0, 1, 1]  # the first, then one resume

    run(scenario)


@pytest.mark.parametrize("attempts", [1, 2, 3])
def test_attempts_bound_the_tries_before_the_first_token(attempts: int) -> None:
    async def scenario() -> None:
        f = fleet(("a:1", "b:1", "c:1", "d:1"), attempts=attempts)
        for replica in ("a:1", "b:1", "c:1", "d:1"):
            f[replica].fail_next(0)
        retries = RETRIES._value.get()
        with pytest.raises(Unavailable):
            await collect(f, call())
        assert RETRIES._value.get() - retries == attempts - 1
        tried = [len(f[r].calls) for r in ("a:1", "b:1", "c:1", "d:1")]
        # Each on another replica.
        assert sorted(tried, reverse=True) == [1] * attempts + [0] * (4 - attempts)

    run(scenario)


def test_no_retry_past_the_deadline() -> None:
    async def scenario() -> None:
        f = fleet()
        f["a:1"].fail_next(0)
        with pytest.raises(Unavailable):
            await collect(f, call(), deadline=time.monotonic())  # already due
        assert len(f["a:1"].calls) == 1 and f["b:1"].calls == []

    run(scenario)


def test_a_replica_that_refuses_the_request_has_not_failed() -> None:
    async def scenario() -> None:
        f = fleet(breaker_failures=1)
        f["a:1"].fail_next(InvalidArgument("sampling.max_tokens", "too many"))
        with pytest.raises(InvalidArgument, match=r"sampling\.max_tokens"):
            await collect(f, call())
        assert f["b:1"].calls == []  # not retried
        # Its breaker (one failure would open it) stays closed: it serves the next one.
        chunks = await collect(f, call())
        assert chunks[-1].route is not None and chunks[-1].route.endpoint in ("a:1", "b:1")
        assert all(c.healthy for c in f.replicas.candidates("llm"))

    run(scenario)


def test_the_breaker_takes_a_failing_replica_out_and_probes_it_after_its_pause() -> None:
    async def scenario() -> None:
        f = fleet(breaker_failures=2, attempts=1)
        f["a:1"].fail_next(0, 0)
        for _ in range(4):  # round robin: a, b, a, b; a fails both times it is tried
            with_a = [c.address for c in f.replicas.candidates("llm") if c.healthy]
            try:
                await collect(f, call(3))
            except Unavailable:
                assert "a:1" in with_a
        healthy = {c.address: c.healthy for c in f.replicas.candidates("llm")}
        assert healthy == {"a:1": False, "b:1": True}
        for _ in range(3):  # all go to b while a's breaker is open
            await collect(f, call(3))
        assert len(f["a:1"].calls) == 2
        f.clock[0] += 2.5  # past its pause: one probe may go to a, and it succeeds
        healthy = {c.address: c.healthy for c in f.replicas.candidates("llm")}
        assert healthy == {"a:1": True, "b:1": True}
        for _ in range(2):
            await collect(f, call(3))
        assert len(f["a:1"].calls) == 3
        assert all(c.healthy for c in f.replicas.candidates("llm"))

    run(scenario)


def test_one_models_failures_leave_the_replicas_other_models_serving() -> None:
    """Fault domains: the breaker of (a, llm) opens, a still serves llm_canary; and a
    model its own reports name as failed is not picked for that model only."""

    async def scenario() -> None:
        f = fleet(("a:1",), breaker_failures=1, attempts=1)
        f["a:1"].fail_next(0)
        with contextlib.suppress(Unavailable):
            await collect(f, call(3))
        healthy = {m: f.replicas.candidates(m)[0].healthy for m in ("llm", "llm_canary")}
        assert healthy == {"llm": False, "llm_canary": True}
        other = replace(call(3), model="llm_canary")
        assert len(await collect(f, other)) == 3
        f.clock[0] += 2.5  # llm's breaker probes again
        report = LoadReport({"llm": {}, "llm_canary": {}}, failed_models=frozenset({"llm"}))
        f["a:1"].reports.put_nowait(report)

        async def reported() -> bool:
            return f.replicas["a:1"].failed_models == {"llm"}

        assert await poll_until_async(reported, 5)
        healthy = {m: f.replicas.candidates(m)[0].healthy for m in ("llm", "llm_canary")}
        assert healthy == {"llm": False, "llm_canary": True}

    run(scenario)


def test_a_healthy_report_after_the_cool_down_closes_the_breaker() -> None:
    """After an outage the reports showed (the engine down): not only one probe request,
    since streams that all fail over at once would find the probe slot taken. Within the
    cool-down a report changes nothing."""

    async def scenario() -> None:
        f = fleet(("a:1",), breaker_failures=1, attempts=1)
        f["a:1"].reports.put_nowait(LoadReport({"llm": {}}, engine_reachable=False))

        async def engine_down() -> bool:
            return not f.replicas["a:1"].engine_reachable

        assert await poll_until_async(engine_down, 5)
        f["a:1"].fail_next(0)
        with contextlib.suppress(Unavailable):
            await collect(f, call(3))
        healthy_report = LoadReport({"llm": {}})

        async def reported_at(moment: float) -> bool:  # the report was taken in
            return f.replicas["a:1"].last_report_at == moment

        f["a:1"].reports.put_nowait(healthy_report)
        assert await poll_until_async(lambda: reported_at(f.clock[0]), 5)
        assert not f.replicas.candidates("llm")[0].healthy  # still cooling down
        f.clock[0] += 2.5
        f["a:1"].reports.put_nowait(healthy_report)
        assert await poll_until_async(lambda: reported_at(f.clock[0]), 5)
        breaker = f.replicas["a:1"].breaker("llm")
        assert breaker.state(f.clock[0]) is BreakerState.CLOSED

    run(scenario)


def test_an_outage_reported_after_the_failures_that_opened_the_breaker_counts_too() -> None:
    """The failures come first (the engine died between two reports), the report of the
    outage a moment later: the breaker is still the reports' to close, so a replica that
    gets no traffic meanwhile (a fallback) is whole again when the engine is back."""

    async def scenario() -> None:
        f = fleet(("a:1",), breaker_failures=1, attempts=1)
        f["a:1"].fail_next(0)
        with contextlib.suppress(Unavailable):
            await collect(f, call(3))

        async def reported_at(moment: float) -> bool:
            return f.replicas["a:1"].last_report_at == moment

        f["a:1"].reports.put_nowait(LoadReport({"llm": {}}, engine_reachable=False))
        assert await poll_until_async(lambda: reported_at(f.clock[0]), 5)
        f.clock[0] += 2.5
        f["a:1"].reports.put_nowait(LoadReport({"llm": {}}))
        assert await poll_until_async(lambda: reported_at(f.clock[0]), 5)
        assert f.replicas["a:1"].breaker("llm").state(f.clock[0]) is BreakerState.CLOSED

    run(scenario)


def test_a_stream_on_a_replica_that_falls_silent_moves_elsewhere_whole() -> None:
    """A partition: the replica's stream and its load reports just stop. Past
    silent_after_s without a report, the stream resumes on another replica, nothing
    lost or repeated."""

    async def scenario() -> None:
        f = fleet(report_interval_s=0.01, silent_after_s=3.0)
        await f.replicas.start()
        try:
            for address in ("a:1", "b:1"):
                f[address].reports.put_nowait(LoadReport({"llm": {}}))

            async def reported() -> bool:
                return all(f.replicas[a].last_report_at for a in ("a:1", "b:1"))

            assert await poll_until_async(reported, 5)
            f["a:1"].fail_next(Hang(after=2))
            streaming = asyncio.create_task(collect(f, call(10)))

            async def stuck() -> bool:
                return bool(f["a:1"].calls)

            assert await poll_until_async(stuck, 5)
            f.clock[0] += 4.0  # a says nothing more; b reports on
            f["b:1"].reports.put_nowait(LoadReport({"llm": {}}))
            chunks = await asyncio.wait_for(streaming, 10)
        finally:
            await f.replicas.close()
        assert "".join(c.text for c in chunks) == expected_text(PROMPT, 10)
        assert chunks[-1].resumed == 1 and len(f["b:1"].calls) == 1

    run(scenario)


def test_streams_in_flight_are_counted_and_released() -> None:
    async def scenario() -> None:
        f = fleet(("a:1",))
        stream = f.dispatcher.generate(call(50), RouteHints())
        await anext(stream)
        [candidate] = f.replicas.candidates("llm")
        assert candidate.in_flight == 1
        await stream.aclose()  # the client left
        [candidate] = f.replicas.candidates("llm")
        assert (candidate.in_flight, candidate.ended) == (0, 1)

    run(scenario)


def test_a_models_card_comes_from_the_next_replica_when_one_cannot_describe_it() -> None:
    async def scenario() -> None:
        f = fleet()
        f["a:1"].card_error = Unavailable("Triton is unavailable")
        assert (await f.dispatcher.describe("llm")).max_context == 2048
        f["b:1"].card_error = Unavailable("Triton is unavailable")
        with pytest.raises(Unavailable, match="could describe it: Triton is unavailable"):
            await f.dispatcher.describe("llm")

    run(scenario)


def test_a_report_stream_stuck_open_or_failing_oddly_is_dialed_again() -> None:
    """Reports that stop on a stream still open, or a stream that fails with something
    unforeseen, must not leave the replica's last report standing for good."""

    async def scenario() -> None:
        f = fleet(("a:1",), report_interval_s=0.01, silent_after_s=0.2)
        f["a:1"].watch_errors.append(RuntimeError("not a status at all"))
        await f.replicas.start()
        try:

            async def redialed_twice() -> bool:
                return f["a:1"].watches >= 3  # after the odd failure, and after the silence

            assert await poll_until_async(redialed_twice, 5)
            f["a:1"].reports.put_nowait(LoadReport({"llm": {}}))

            async def healthy() -> bool:
                return f.replicas.can_serve("llm") and f.replicas["a:1"].last_report_at is not None

            assert await poll_until_async(healthy, 5)
        finally:
            await f.replicas.close()

    run(scenario)


def test_each_report_taken_in_tells_the_listeners() -> None:
    """Admission waits on the engines' queues: each report is its cue to look again."""

    async def scenario() -> None:
        f = fleet(("a:1",))
        heard: list[int] = []
        f.replicas.on_report(lambda: heard.append(len(f.replicas["a:1"].reports)))
        f["a:1"].reports.put_nowait(LoadReport({"llm": {"waiting": 3}}))

        async def heard_it() -> bool:
            return bool(heard)

        assert await poll_until_async(heard_it, 5)
        assert heard[0] == 1  # called once the report was taken in

    run(scenario)


def test_the_fleet_admission_sees_is_where_the_split_sends_traffic() -> None:
    """A canary at weight 0 and another region's replica serve only what is pinned or
    failed over to them: their idle engines neither end the fleet's saturation nor add
    running slots. With none of the weighted subsets reporting, every replica counts."""

    async def scenario() -> None:
        f = fleet(("a:1", "b:1", "c:1"))
        f.replicas.apply(
            [
                Endpoint(address="a:1"),
                Endpoint(address="b:1", version="canary"),
                Endpoint(address="c:1", region="far"),
            ]
        )
        queued = {"llm": {"waiting": 3.0, "max_running_sequences": 32.0}}
        idle = {"llm": {"waiting": 0.0, "max_running_sequences": 32.0}}
        for address, load in (("a:1", queued), ("b:1", idle), ("c:1", idle)):
            f[address].reports.put_nowait(LoadReport(load))

        async def all_reported() -> bool:
            return all(f.replicas[a].last_report_at is not None for a in ("a:1", "b:1", "c:1"))

        assert await poll_until_async(all_reported, 5)

        def dispatcher(split: dict[str, float]) -> Dispatcher:
            routing = PolicyHolder(RoutingPolicy(split=split))
            scheduler = Scheduler(SchedulingState("local"))
            return Dispatcher(f.replicas, routing, PoolSettings(), scheduler)

        canary_at_zero = dispatcher({"stable": 100, "canary": 0})
        assert canary_at_zero.saturated() and canary_at_zero.running_slots() == 32
        canary_at_half = dispatcher({"stable": 50, "canary": 50})
        assert not canary_at_half.saturated() and canary_at_half.running_slots() == 64
        only_elsewhere = dispatcher({"blue": 100})  # no replica of it reports: all count
        assert not only_elsewhere.saturated() and only_elsewhere.running_slots() == 96

    run(scenario)


def test_saturation_at_a_priority_counts_only_work_at_least_as_urgent() -> None:
    """An engine's queue by priority: ten sheddable generations (2) and one critical (0)
    wait. A critical request would wait behind one (no saturation at 0 or 1), a sheddable
    one behind eleven; an engine that reports no queue by priority is read whole."""
    by_priority = {
        "waiting": 11.0,
        f"{WAITING_BY_PRIORITY}0": 1.0,
        f"{WAITING_BY_PRIORITY}2": 10.0,
    }
    assert [waiting_as_urgent(by_priority, p) for p in (None, 0, 1, 2, 3)] == [11, 1, 1, 11, 11]
    assert waiting_as_urgent({"waiting": 5.0}, 0) == 5

    async def scenario() -> None:
        f = fleet(("a:1",))
        f.replicas.apply([Endpoint(address="a:1")])
        f["a:1"].reports.put_nowait(LoadReport({"llm": by_priority}))

        async def reported() -> bool:
            return f.replicas["a:1"].last_report_at is not None

        assert await poll_until_async(reported, 5)
        routing = PolicyHolder(RoutingPolicy())
        scheduler = Scheduler(SchedulingState("local"))
        dispatcher = Dispatcher(f.replicas, routing, PoolSettings(), scheduler)
        assert dispatcher.saturated() and dispatcher.saturated(2)
        assert not dispatcher.saturated(0) and not dispatcher.saturated(1)
        # What a request of each priority sees of the replica's queue when it is picked.
        waiting = [f.replicas.candidates("llm", p)[0].waiting for p in (None, 0, 2)]
        assert waiting == [11, 1, 11]

    run(scenario)


def test_a_session_stays_on_a_replica_whose_queue_is_only_less_urgent_work() -> None:
    """The session's replica queues ten sheddable generations: a critical request of the
    conversation (priority 0) runs ahead of them there and keeps its affinity; a sheddable
    one (2) would wait behind them all, and goes to the idle replica."""
    lower_only = {"running": 1.0, "waiting": 10.0, f"{WAITING_BY_PRIORITY}2": 10.0}

    async def scenario() -> None:
        f = fleet(("a:1", "b:1"))
        f["a:1"].reports.put_nowait(LoadReport({"llm": lower_only}))
        f["b:1"].reports.put_nowait(LoadReport({"llm": {"running": 0.0, "waiting": 0.0}}))

        async def reported() -> bool:
            return all(f.replicas[a].last_report_at is not None for a in ("a:1", "b:1"))

        assert await poll_until_async(reported, 5)
        scheduler = Scheduler(SchedulingState("local", rng=random.Random(0)))
        routing = PolicyHolder(RoutingPolicy())
        dispatcher = Dispatcher(f.replicas, routing, PoolSettings(), scheduler)
        for priority, expected in ((0, "a:1"), (2, "b:1"), (None, "b:1")):
            scheduler.state.sessions.set("t/s", "a:1", "stable")
            before = {a: len(f[a].calls) for a in ("a:1", "b:1")}
            hints = RouteHints(session_key="t/s")
            asked = replace(call(4), priority=priority)
            assert [c async for c in dispatcher.generate(asked, hints)][-1].finish_reason
            went = [a for a in ("a:1", "b:1") if len(f[a].calls) > before[a]]
            assert went == [expected], priority

    run(scenario)


def test_the_fleets_running_slots_are_each_replicas_largest_engine_limit() -> None:
    """What admission sizes its window to without engine priority: per replica the largest
    running limit among its models (traffic for one model fills only its engine), over
    the replicas that report and reach their engine; 0 when none reports one."""

    async def scenario() -> None:
        f = fleet(("a:1", "b:1", "c:1"))
        assert f.replicas.running_slots() == 0
        limits: dict[str, dict[str, float]] = {
            "llm": {"max_running_sequences": 32.0},
            "small": {"max_running_sequences": 8.0},
        }
        f["a:1"].reports.put_nowait(LoadReport(limits))
        f["b:1"].reports.put_nowait(LoadReport({"llm": {"max_running_sequences": 16.0}}))
        f["c:1"].reports.put_nowait(LoadReport(limits, engine_reachable=False))

        async def all_reported() -> bool:
            return all(f.replicas[a].last_report_at is not None for a in ("a:1", "b:1", "c:1"))

        assert await poll_until_async(all_reported, 5)
        assert f.replicas.running_slots() == 32 + 16
        f.clock[0] += 3600  # the reports went stale
        assert f.replicas.running_slots() == 0

    run(scenario)

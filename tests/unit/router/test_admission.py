"""The admission queue: priority, fairness, deadlines, cancellation, shedding, the window."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest
from prometheus_client import REGISTRY

from llmmesh.runtime.errors import DeadlineExceeded, ResourceExhausted
from services.router.admission import AdmissionQueue, AdmissionSettings, Slot


async def run_ready_tasks() -> None:
    """One turn of the event loop: tasks created so far run up to their first wait."""
    loop = asyncio.get_running_loop()
    turn = loop.create_future()
    loop.call_soon(turn.set_result, None)
    await turn


def queue(
    limit: float = 1, clock: Callable[[], float] = time.monotonic, **kw: object
) -> AdmissionQueue:
    settings = AdmissionSettings(initial_limit=limit, min_limit=1, max_limit=64, **kw)  # type: ignore[arg-type]
    return AdmissionQueue(settings, clock=clock)


async def order_of_admission(q: AdmissionQueue, requests: list[tuple[str, str, int]]) -> list[str]:
    """Holds the only slot, queues ``requests`` (tenant, tier, cost), then releases slots
    one by one; returns the tenants in the order they got in."""
    holder = await q.acquire("holder", "standard", 1, None)
    admitted: list[str] = []

    async def one(tenant: str, tier: str, cost: int, label: str) -> None:
        slot = await q.acquire(tenant, tier, cost, None)
        admitted.append(label)
        slot.release(None)

    tasks = []
    for n, (tenant, tier, cost) in enumerate(requests):
        tasks.append(asyncio.create_task(one(tenant, tier, cost, f"{tenant}{n}")))
        await run_ready_tasks()  # enqueue in this order
    holder.release(None)
    await asyncio.gather(*tasks)
    return admitted


def test_strict_priority_between_tiers() -> None:
    got = asyncio.run(
        order_of_admission(
            queue(),
            [("s", "sheddable", 1), ("b", "standard", 1), ("c", "critical", 1)],
        )
    )
    assert got == ["c2", "b1", "s0"]


def test_tenants_of_a_tier_share_by_tokens_served() -> None:
    # "big" sends expensive requests first; "small" still gets every other turn or more.
    requests = [("big", "standard", 100)] * 4 + [("small", "standard", 10)] * 4
    got = asyncio.run(order_of_admission(queue(), requests))
    first_four = [label.rstrip("0123456789") for label in got[:4]]
    assert first_four.count("small") >= 3


def test_earliest_deadline_first_within_a_tenant() -> None:
    async def scenario() -> list[str]:
        q = queue()
        holder = await q.acquire("t", "standard", 1, None)
        now = time.monotonic()
        order: list[str] = []

        async def one(label: str, deadline: float) -> None:
            slot = await q.acquire("t", "standard", 1, deadline)
            order.append(label)
            slot.release(None)

        late = asyncio.create_task(one("late", now + 4))
        await run_ready_tasks()
        soon = asyncio.create_task(one("soon", now + 2))
        await run_ready_tasks()
        holder.release(None)
        await asyncio.gather(late, soon)
        return order

    assert asyncio.run(scenario()) == ["soon", "late"]


def test_a_standing_queue_lets_the_newest_in_first() -> None:
    """Once a tenant's oldest request has waited half its tier's target, arrival order
    would make every later one late too: the newest go first, and the shed estimate for a
    newcomer no longer counts the whole queue ahead of it."""

    async def scenario() -> list[str]:
        now = [0.0]
        q = queue(clock=lambda: now[0])  # standard's target: 1 s
        for _ in range(30):  # a pace to go by: 3 releases/s over the last 10 s
            (await q.acquire("holder", "standard", 1, None)).release(None)
        holder = await q.acquire("holder", "standard", 1, None)
        order: list[str] = []

        async def one(label: str) -> None:
            slot = await q.acquire("t", "standard", 1, None)
            order.append(label)
            slot.release(None)

        tasks = []
        for n in range(3):
            now[0] = n * 0.1
            tasks.append(asyncio.create_task(one(f"r{n}")))
            await run_ready_tasks()
        moving = q.expected_wait_s("standard")
        now[0] = 0.2 + 0.4  # the oldest has waited 0.6 s: the queue stands
        assert q.expected_wait_s("standard") < moving
        holder.release(None)
        await asyncio.gather(*tasks)
        return order

    assert asyncio.run(scenario()) == ["r2", "r1", "r0"]


def test_a_cancelled_waiter_gives_its_place_up() -> None:
    async def scenario() -> None:
        q = queue(engine_priority=False)  # a critical request waits behind a standard one
        holder = await q.acquire("t", "standard", 1, None)
        gone = asyncio.create_task(q.acquire("a", "critical", 1, None))
        stays = asyncio.create_task(q.acquire("b", "standard", 1, None))
        await run_ready_tasks()
        gone.cancel()
        with pytest.raises(asyncio.CancelledError):
            await gone
        holder.release(None)
        slot: Slot = await asyncio.wait_for(stays, 5)
        assert slot.ticket.tenant == "b" and q.in_flight == 1

    asyncio.run(scenario())


def test_a_request_not_served_by_its_deadline_is_told_so() -> None:
    async def scenario() -> None:
        q = queue(
            max_queue_wait_s={"critical": 0.05, "standard": 5.0, "sheddable": 1.0},
            engine_priority=False,  # a critical request waits behind a standard one
        )
        await q.acquire("t", "standard", 1, None)
        with pytest.raises(DeadlineExceeded):
            await q.acquire("c", "critical", 1, None)
        assert q.expected_wait_s("critical") >= 0 and q.in_flight == 1

    asyncio.run(scenario())


def test_sheddable_is_refused_at_once_when_saturated() -> None:
    async def scenario() -> None:
        settings = AdmissionSettings(initial_limit=1, min_limit=1, engine_priority=False)
        q = AdmissionQueue(settings, lambda priority: True)
        await q.acquire("t", "standard", 1, None)
        with pytest.raises(ResourceExhausted) as info:
            await q.acquire("s", "sheddable", 1, None)
        assert info.value.retry_after_s > 0
        # Critical still queues (its deadline can be met).
        waiting = asyncio.create_task(q.acquire("c", "critical", 1, None))
        await run_ready_tasks()
        assert not waiting.done()
        waiting.cancel()

    asyncio.run(scenario())


def test_the_window_grows_on_met_targets_and_shrinks_on_misses() -> None:
    async def scenario() -> None:
        q = queue(limit=4)
        slots = [await q.acquire("t", "standard", 1, None) for _ in range(4)]
        for slot in slots:
            slot.release(slot.ticket.granted_at + 0.01)  # fast first tokens, window full: grow
        grown = q.limit
        assert grown > 4
        lower = await q.acquire("s", "sheddable", 1, None)  # load the window could shed
        slot = await q.acquire("t", "standard", 1, None)
        slot.release(slot.ticket.granted_at + 10.0)  # a missed target: shrink
        assert q.limit == pytest.approx(grown * 0.9)
        lower.release(None)

    asyncio.run(scenario())


def test_the_window_shrinks_once_for_misses_of_requests_let_in_before_it_shrank() -> None:
    async def scenario() -> None:
        now = [0.0]
        q = queue(limit=10, clock=lambda: now[0])
        lower = await q.acquire("s", "sheddable", 1, None)  # load the window could shed
        first, second = [await q.acquire("t", "standard", 1, None) for _ in range(2)]
        now[0] = 1.0
        first.release(now[0] + 5.0)  # a first token 6 s after the slot: a miss
        assert q.limit == pytest.approx(9)
        second.release(now[0] + 5.0)  # let in under the old window: no news
        assert q.limit == pytest.approx(9)
        third = await q.acquire("t", "standard", 1, None)
        now[0] = 2.0
        third.release(now[0] + 5.0)  # let in after the decrease: shrinks again
        assert q.limit == pytest.approx(8.1)
        lower.release(None)

    asyncio.run(scenario())


def test_misses_do_not_shrink_the_window_below_what_the_strictest_tier_holds() -> None:
    async def scenario() -> None:
        q = queue(limit=10, decrease=0.5)
        critical = [await q.acquire("c", "critical", 1, None) for _ in range(8)]
        critical[0].release(critical[0].ticket.granted_at + 10.0)  # only critical in flight
        assert q.limit == 10  # shrinking would only queue critical behind itself
        standard = await q.acquire("s", "standard", 1, None)
        critical[1].release(critical[1].ticket.granted_at + 10.0)
        assert q.limit == 6  # halving would give 5, but critical still holds 6
        for slot in [*critical[2:], standard]:
            slot.release(None)

    asyncio.run(scenario())


def test_lower_tiers_leave_headroom_for_critical() -> None:
    """Without engine priority: a lower tier's slot cannot be taken back by the engine."""

    async def scenario() -> None:
        q = queue(limit=10, engine_priority=False)
        held = [await q.acquire("s", "standard", 1, None) for _ in range(8)]
        standard = asyncio.create_task(q.acquire("s", "standard", 1, None))
        await run_ready_tasks()
        assert not standard.done()  # 80% of the window is standard's share
        critical = await asyncio.wait_for(q.acquire("c", "critical", 1, None), 5)
        assert q.in_flight == 9
        critical.release(None)
        held[0].release(None)
        await asyncio.wait_for(standard, 5)

    asyncio.run(scenario())


async def ten_seconds_of_critical_traffic(q: AdmissionQueue, now: list[float]) -> None:
    """Critical traffic at 1 request/s, each holding its slot for 4 s: about 4 at once, 8
    with room for bursts; the clock is left at 10 s."""
    for arrival in range(10):
        now[0] = arrival + 0.5
        slot = await q.acquire("c", "critical", 1, None)
        slot.ticket.granted_at = now[0] - 4.0
        slot.release(None)
    now[0] = 10.0


@pytest.mark.parametrize(
    ("engine_priority", "room"),
    [
        (False, 8),  # 7 + 8 reserved < 16, the standard share of 20
        (True, 12),  # 11 + 8 reserved < 20: no share, the engine preempts, yet each
        # reserved slot taken would come back as a preemption
    ],
)
def test_lower_tiers_leave_free_what_critical_traffic_is_about_to_need(
    engine_priority: bool, room: int
) -> None:
    async def scenario() -> None:
        now = [0.0]
        q = queue(limit=20, clock=lambda: now[0], engine_priority=engine_priority)
        await ten_seconds_of_critical_traffic(q, now)  # 8 slots reserved of 20
        held = [await q.acquire("s", "standard", 1, None) for _ in range(room)]
        waiting = asyncio.create_task(q.acquire("s", "standard", 1, None))
        await run_ready_tasks()
        assert not waiting.done()  # one more would take a slot critical is about to need
        critical = await asyncio.wait_for(q.acquire("c", "critical", 1, None), 5)
        critical.release(None)
        now[0] += 60.0  # critical traffic stopped: nothing is reserved for it any more
        held.pop().release(None)
        await asyncio.wait_for(waiting, 5)
        for slot in held:
            slot.release(None)

    asyncio.run(scenario())


@pytest.mark.parametrize("engine_priority", [True, False])
def test_the_window_grows_while_work_waits_for_room_only_if_the_engines_preempt(
    engine_priority: bool,
) -> None:
    """Slots kept for critical traffic hold a standard request back below a full window:
    with engine priority the engines could run it (they take a slot back by preemption),
    so a met target grows the window; without, the tier's share is critical's headroom."""

    async def scenario() -> None:
        now = [0.0]
        q = queue(limit=20, clock=lambda: now[0], engine_priority=engine_priority)
        await ten_seconds_of_critical_traffic(q, now)  # 8 slots reserved of 20
        room = 12 if engine_priority else 8
        held = [await q.acquire("s", "standard", 1, None) for _ in range(room)]
        waiting = asyncio.create_task(q.acquire("s", "standard", 1, None))
        await run_ready_tasks()
        assert not waiting.done() and q.in_flight + 1 < q.limit
        held.pop().release(now[0] + 0.01)  # its first token on time
        assert (q.limit > 20) is engine_priority
        await asyncio.wait_for(waiting, 5)  # the freed slot goes to the waiter either way
        for slot in held:
            slot.release(None)

    asyncio.run(scenario())


@pytest.mark.parametrize(("running_slots", "grown_to"), [(0.0, 10.0), (12.0, 12.0)])
def test_without_engine_priority_the_window_grows_to_the_fleets_running_slots(
    running_slots: float, grown_to: float
) -> None:
    """A tier held to its share waits by design (the rest is critical's headroom), but the
    share is of what the engines run at once: with the fleet's running slots reported,
    met targets while standard work waits at its share (8 of a window of 10, so the
    window is not full) grow the window up to them, and no further; with none reported
    the window stays."""

    async def scenario() -> None:
        settings = AdmissionSettings(
            initial_limit=10,
            engine_priority=False,
            max_queue_wait_s={"critical": 30.0, "standard": 60.0, "sheddable": 1.0},
        )
        q = AdmissionQueue(settings, running_slots=lambda: running_slots)
        held: list[Slot] = []
        for _ in range(60):  # each round: a waiter, then a slot released on time
            waiter = asyncio.create_task(q.acquire("s", "standard", 1, None))
            await run_ready_tasks()  # admitted at once while the share has room
            if waiter.done():
                held.append(waiter.result())
                continue
            assert q.in_flight + 1 < q.limit  # the share binds, not the window
            held.pop(0).release(time.monotonic())
            held.append(await asyncio.wait_for(waiter, 5))
        assert grown_to <= q.limit < grown_to + 0.1
        for slot in held:
            slot.release(None)

    asyncio.run(scenario())


@pytest.mark.parametrize(("engine_priority", "window"), [(False, 8.0), (True, 32.0)])
def test_without_engine_priority_a_window_above_the_fleets_slots_comes_down_to_them(
    engine_priority: bool, window: float
) -> None:
    """Engines that serve in arrival order would queue the lower tiers' share of a window
    larger than their slots ahead of the next critical arrivals: a report of 8 slots
    brings the initial 32 down to 8. Engines that preempt may hold lower tiers' work
    beyond their slots: the window stays."""
    settings = AdmissionSettings(initial_limit=32, engine_priority=engine_priority)
    q = AdmissionQueue(settings, running_slots=lambda: 8.0)
    q.fleet_changed()  # the first load report
    assert q.limit == window


def test_without_engine_priority_a_full_window_grows_no_further_than_the_fleets_slots() -> None:
    async def scenario() -> None:
        settings = AdmissionSettings(initial_limit=8, engine_priority=False)
        q = AdmissionQueue(settings, running_slots=lambda: 8.0)
        held = [await q.acquire("c", "critical", 1, None) for _ in range(8)]
        for slot in held:
            slot.release(time.monotonic())  # each on time, with the window full
        assert q.limit == 8
        q = AdmissionQueue(settings)  # no slots reported: it grows as before
        held = [await q.acquire("c", "critical", 1, None) for _ in range(8)]
        held[0].release(time.monotonic())
        assert q.limit > 8
        for slot in held[1:]:
            slot.release(None)

    asyncio.run(scenario())


def test_a_router_of_a_fleet_holds_its_share_of_the_window() -> None:
    """With N routers, each holds 1/N of the window, and its bounds: rebalanced when a
    router joins or leaves."""
    q = queue(limit=32)
    q.set_share(1 / 2)  # a second router joined
    assert q.limit == 16
    q.set_share(1 / 4)
    assert q.limit == 8
    q.limit = 64 / 4  # at the top of its share of the bounds (max_limit 64)
    q.set_share(1)  # the others left: the whole window again
    assert q.limit == 64


def test_with_engine_priority_every_tier_may_fill_the_window() -> None:
    """The engine preempts a lower tier's generation for a higher one: sheddable may fill
    the window, and a critical request still goes straight in (the slots lower tiers hold
    are the engine's to take back); each tier counts its own and the higher tiers'."""

    async def scenario() -> None:
        q = queue(limit=4)
        held = [await q.acquire("s", "sheddable", 1, None) for _ in range(4)]
        sheddable = asyncio.create_task(q.acquire("s", "sheddable", 1, None))
        critical = await asyncio.wait_for(q.acquire("c", "critical", 1, None), 5)
        assert q.in_flight == 5 and not sheddable.done()
        standard = [await q.acquire("t", "standard", 1, None) for _ in range(3)]
        waiting = asyncio.create_task(q.acquire("t", "standard", 1, None))
        await run_ready_tasks()
        assert not waiting.done()  # critical and standard hold 4: the window is theirs
        critical.release(None)
        await asyncio.wait_for(waiting, 5)  # the freed slot goes to the higher tier
        assert not sheddable.done()
        for slot in [*held, *standard]:
            slot.release(None)
        await asyncio.wait_for(sheddable, 5)

    asyncio.run(scenario())


def test_with_engine_priority_lower_tiers_wait_here_while_the_engines_queue() -> None:
    """While a higher tier is about, a lower tier's request that would only queue in the
    engines waits in the router (where the newest go first and the hopeless are refused);
    critical still goes in, and a load report showing room lets the waiter go. A tier
    alone goes in: its own queue is as well in the engines."""

    async def scenario() -> None:
        saturated, now = [True], [0.0]
        settings = AdmissionSettings(initial_limit=8, min_limit=1)
        q = AdmissionQueue(settings, lambda priority: saturated[0], clock=lambda: now[0])
        alone = await asyncio.wait_for(q.acquire("t", "standard", 1, None), 5)
        critical = await asyncio.wait_for(q.acquire("c", "critical", 1, None), 5)
        standard = asyncio.create_task(q.acquire("t", "standard", 1, None))
        await run_ready_tasks()
        assert not standard.done()
        q.fleet_changed()  # a report, still saturated
        assert not standard.done()
        saturated[0] = False
        q.fleet_changed()
        slot = await asyncio.wait_for(standard, 5)
        for held in (slot, critical, alone):
            held.release(None)
        saturated[0] = True
        now[0] += 60  # critical's arrivals are past
        later = await asyncio.wait_for(q.acquire("t", "standard", 1, None), 5)
        later.release(None)

    asyncio.run(scenario())


def test_with_engine_priority_only_a_queue_as_urgent_as_a_tier_holds_it_back() -> None:
    """Engines whose queue is lower tiers' preempted work would run a critical or standard
    request ahead of it: the window still grows on critical's met targets, standard still
    goes in while critical is about; sheddable, behind that queue, waits here. Read
    through the engine's whole queue, the window froze and critical queued here for
    seconds (a run's critical TTFT p50 grew from 0.1 to 4 s)."""

    async def scenario() -> None:
        engine_queue = {2: 10}  # by priority: ten sheddable generations wait
        queried: list[int | None] = []

        def saturated(priority: int | None) -> bool:
            queried.append(priority)
            counted = (n for p, n in engine_queue.items() if priority is None or p <= priority)
            return sum(counted) >= 2

        q = AdmissionQueue(AdmissionSettings(initial_limit=4, min_limit=1), saturated)
        critical = [await q.acquire("c", "critical", 1, None) for _ in range(3)]
        standard = await asyncio.wait_for(q.acquire("t", "standard", 1, None), 5)
        for slot in critical:
            slot.release(slot.ticket.granted_at + 0.01)  # met targets, window full: grows
        assert q.limit > 4 and 0 in queried
        with pytest.raises(ResourceExhausted):  # behind that queue: refused
            await q.acquire("s", "sheddable", 1, None)
        assert 2 in queried
        standard.release(None)

    asyncio.run(scenario())


def test_without_engine_priority_any_queue_holds_the_window() -> None:
    async def scenario() -> None:
        queried: list[int | None] = []

        def saturated(priority: int | None) -> bool:
            queried.append(priority)
            return True

        settings = AdmissionSettings(initial_limit=4, min_limit=1, engine_priority=False)
        q = AdmissionQueue(settings, saturated)
        slots = [await q.acquire("c", "critical", 1, None) for _ in range(4)]
        for slot in slots:
            slot.release(slot.ticket.granted_at + 0.01)
        assert q.limit == 4 and set(queried) == {None}

    asyncio.run(scenario())


def test_the_slots_each_tier_holds_are_exported() -> None:
    """llm_router_admitted_requests{tier}: what each tier holds of the window, beside the
    window itself and the queue (a lower tier's preempted generations hold theirs)."""

    def held(tier: str) -> float:
        return REGISTRY.get_sample_value("llm_router_admitted_requests", {"tier": tier}) or 0.0

    async def scenario() -> None:
        q = queue(limit=4)
        before = {tier: held(tier) for tier in ("critical", "sheddable")}
        slots = [await q.acquire("t", "critical", 1, None) for _ in range(2)]
        shed = await q.acquire("u", "sheddable", 1, None)
        assert held("critical") - before["critical"] == 2
        assert held("sheddable") - before["sheddable"] == 1
        for slot in [*slots, shed]:
            slot.release(None)
            slot.release(None)  # once only
        assert {tier: held(tier) for tier in before} == before

    asyncio.run(scenario())

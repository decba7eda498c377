"""A model that stops answering is found, its streams ended with a clear status, named
failed, reloaded and probed back: the inference core over an in-memory backend."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest

from llmmesh.runtime.errors import Unavailable
from llmmesh.types import Chunk, FinishReason, InferenceCall, ModelCard, Sampling
from llmmesh.waiting import poll_until_async
from services.inference.core import InferenceCore
from services.inference.health import EngineUnreachable, HealthKeeper, ModelHealth
from services.inference.load import ModelLoad
from services.inference.triton import ModelInstanceFailed

CALL = InferenceCall("r1", "llm", "hello", Sampling(max_tokens=4))


@dataclass
class Backend:
    """Streams four tokens; ``hang`` makes every generation go silent after its first;
    ``dead`` fails every generation as a dead backend process does; ``down`` is Triton
    itself gone (nothing answers, a reload cannot be asked); probes and reloads as
    Triton's model control answers them."""

    hang: bool = False
    dead: bool = False
    down: bool = False
    reloads: int = 0
    probes: int = 0
    described: list[str] = field(default_factory=list)
    release: asyncio.Event = field(default_factory=asyncio.Event)

    async def generate(self, call: InferenceCall) -> AsyncIterator[Chunk]:
        if self.dead:
            raise ModelInstanceFailed(f"model '{call.model}' has no working instance here")
        for i in range(call.sampling.max_tokens):
            yield Chunk("x", 1, FinishReason.LENGTH if i == call.sampling.max_tokens - 1 else None)
            if self.hang:
                await self.release.wait()

    async def describe(self, model: str) -> ModelCard:
        self.described.append(model)
        return ModelCard(model, max_context=2048, chat_template="{{ messages }}")

    async def probe(self, model: str, timeout_s: float) -> None:
        self.probes += 1
        if self.down:
            raise EngineUnreachable("Triton is unavailable")
        if self.dead or self.hang:
            raise Unavailable(f"model '{model}' did not answer")

    async def reload(self, model: str) -> bool:
        if self.down:
            return False
        self.reloads += 1
        self.dead = self.hang = False
        return True


def harness(
    backend: Backend, probe_interval_s: float = 60.0, stall_s: float = 0.2
) -> tuple[InferenceCore, HealthKeeper]:
    health = ModelHealth(stall_s=stall_s)
    keeper = HealthKeeper(health, backend, lambda: ["llm"], probe_interval_s)
    core = InferenceCore(backend, 64, None, health, keeper.failed)
    keeper.start()
    return core, keeper


async def drain(core: InferenceCore) -> list[Chunk]:
    return [chunk async for chunk in core.generate(CALL)]


def test_a_stalled_model_ends_its_streams_unavailable_and_comes_back() -> None:
    async def scenario() -> None:
        backend = Backend(hang=True)
        core, keeper = harness(backend)
        try:
            streams = [asyncio.create_task(drain(core)) for _ in range(3)]
            for stream in streams:  # every stream in flight ends, none hangs
                with pytest.raises(Unavailable, match="stalled"):
                    await asyncio.wait_for(stream, 10)
            # Reloaded and probed back (the fake reload mends it).
            assert await poll_until_async(lambda: _answering(core), 10)
            assert backend.reloads >= 1
            assert len(await drain(core)) == 4
        finally:
            await keeper.close()

    asyncio.run(scenario())


def test_quiet_streams_of_a_dead_backend_end_before_the_stall_time() -> None:
    """All streams quiet for the probe interval: the model is probed, a dead backend
    fails the probe, and the streams end then (the stall time here is a minute)."""

    async def scenario() -> None:
        backend = Backend(hang=True)
        core, keeper = harness(backend, probe_interval_s=0.1, stall_s=60.0)
        try:
            streams = [asyncio.create_task(drain(core)) for _ in range(2)]
            for stream in streams:  # well before the stall time
                with pytest.raises(Unavailable, match="stopped answering"):
                    await asyncio.wait_for(stream, 10)
            assert await poll_until_async(lambda: _reloaded(backend), 5)  # and brought back
        finally:
            await keeper.close()

    asyncio.run(scenario())


def test_quiet_streams_are_probed_soon_and_at_most_so_often() -> None:
    """Streams quiet for quiet_probe_s get the model probed well before the idle probe
    interval (a minute here); a live one that stays quiet is probed again only after
    another quiet_probe_s."""

    async def scenario() -> int:
        backend = Backend()
        health = ModelHealth(stall_s=60.0)
        keeper = HealthKeeper(health, backend, lambda: ["llm"], 60.0, quiet_probe_s=0.2)
        keeper.start()
        try:
            async with health.watching("llm"):
                assert await poll_until_async(lambda: _probed_often(backend, times=1), 5)
                started = time.monotonic()
                assert await poll_until_async(lambda: _probed_often(backend, times=3), 5)
                elapsed = time.monotonic() - started
            assert not health.failed
            return round(elapsed / 0.2)
        finally:
            await keeper.close()

    assert asyncio.run(scenario()) >= 2  # two more probes: two more quiet periods


def test_quiet_streams_of_a_live_backend_go_on() -> None:
    """A model that answers the probe while its streams are quiet (a long prefill) is
    left alone."""

    async def scenario() -> None:
        backend = Backend()
        health = ModelHealth(stall_s=60.0)
        keeper = HealthKeeper(health, backend, lambda: ["llm"], 0.05)
        keeper.start()
        try:
            async with health.watching("llm"):
                assert await poll_until_async(lambda: _probed(backend), 5)
            assert not health.failed
        finally:
            await keeper.close()

    asyncio.run(scenario())


async def _answering(core: InferenceCore) -> bool:
    return not core.health.failed


def test_a_dead_backend_process_fails_the_model_until_it_is_reloaded() -> None:
    async def scenario() -> None:
        backend = Backend(dead=True)
        health = ModelHealth(stall_s=0.2)
        core = InferenceCore(backend, 64, None, health)  # no keeper: it stays failed
        with pytest.raises(Unavailable, match="no working instance"):
            await drain(core)
        with pytest.raises(Unavailable, match="not answering here"):  # refused at once now
            await drain(core)
        assert health.failed == {"llm": "backend process"}
        # Load reports name it, under the mesh's name, even without engine statistics.
        assert core.mesh_view([]) == (ModelLoad("llm", failed=True),)
        assert core.mesh_view([ModelLoad("llm", running=2)])[0].failed

    asyncio.run(scenario())


def test_an_idle_model_is_probed_and_failed_if_it_does_not_answer() -> None:
    async def scenario() -> None:
        backend = Backend()
        core, keeper = harness(backend, probe_interval_s=0.05)
        try:
            assert await poll_until_async(lambda: _probed(backend), 5)
            assert not core.health.failed  # it answered
            backend.hang = True  # silent from now on: the next probe finds out, and the
            assert await poll_until_async(lambda: _reloaded(backend), 5)  # model is reloaded
        finally:
            await keeper.close()

    asyncio.run(scenario())


def test_an_unreachable_triton_fails_no_model_and_a_failed_one_comes_back_unreloaded() -> None:
    """Triton not running (yet, or any more) is the engine's outage, which load reports
    show: an idle probe then fails no model. A model failed otherwise (it stalled) while
    Triton is down is probed back when the restarted Triton has loaded it again, and no
    reload unloads that new instance."""

    async def scenario() -> None:
        backend = Backend(down=True)
        core, keeper = harness(backend, probe_interval_s=0.05)
        try:
            assert await poll_until_async(lambda: _probed_often(backend), 5)
            assert not core.health.failed
            core.health.fail("llm", "stalled")
            keeper.failed("llm", "stalled")  # recovery: probes while Triton is down
            assert await poll_until_async(lambda: _probed_often(backend, 8), 5)
            backend.down = False  # the restarted Triton has loaded the model
            assert await poll_until_async(lambda: _answering(core), 5)
            assert backend.reloads == 0
        finally:
            await keeper.close()

    asyncio.run(scenario())


async def _probed_often(backend: Backend, times: int = 3) -> bool:
    return backend.probes >= times


async def _failed(core: InferenceCore) -> bool:
    return bool(core.health.failed)


async def _probed(backend: Backend) -> bool:
    return backend.probes >= 2


async def _reloaded(backend: Backend) -> bool:
    return backend.reloads >= 1


def test_a_busy_model_is_not_stalled_by_one_slow_stream() -> None:
    """Stall means no response on any stream: one stream waiting while others of the
    model progress is not a stall."""

    async def scenario() -> None:
        now = [0.0]
        health = ModelHealth(stall_s=0.2, clock=lambda: now[0])
        async with health.watching("llm") as slow, health.watching("llm") as busy:
            for _ in range(10):  # the busy stream answers every 50 ms, the slow one never
                now[0] += 0.05
                busy()
                assert health.stalled() == []
            now[0] += 0.25  # then neither does
            assert health.stalled() == ["llm"]
            slow()
            assert health.stalled() == []

    asyncio.run(scenario())


def test_ending_streams_again_before_they_ended_is_harmless() -> None:
    """The watchdog ticks again while the streams it ended are still unwinding: an
    expiring timeout must not be rescheduled (asyncio refuses, and the watchdog died)."""

    async def scenario() -> None:
        health = ModelHealth(stall_s=0.2)
        release = asyncio.Event()

        async def stream() -> None:
            async with health.watching("llm"):
                await release.wait()

        task = asyncio.create_task(stream())

        async def watching() -> bool:
            return health.in_flight("llm") == 1

        assert await poll_until_async(watching, 5)
        health.end_streams("llm")
        # Exactly one step of the loop, which is the state under test: the expiry callback
        # queued before this task runs, the stream task it cancels is queued after it. Not
        # a wait for something: waiting on any condition would let the stream unwind first.
        await asyncio.sleep(0)
        health.end_streams("llm")
        with pytest.raises(Unavailable, match="stalled"):
            await task

    asyncio.run(scenario())


def test_a_models_card_is_asked_of_the_model_and_named_as_the_mesh_names_it() -> None:
    async def scenario() -> None:
        backend = Backend()
        core = InferenceCore(backend, 64, {"llm": "llm_canary"}, ModelHealth(stall_s=0.2))
        card = await core.describe("llm")
        assert card == ModelCard("llm", 2048, chat_template="{{ messages }}")
        assert backend.described == ["llm_canary"]  # the Triton model behind the alias
        core.health.fail("llm_canary", "stalled")
        with pytest.raises(Unavailable, match="not answering here"):
            await core.describe("llm")

    asyncio.run(scenario())

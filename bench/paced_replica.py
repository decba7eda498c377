"""A benchmark harness, never part of the product: an inference replica whose engine is a
clock. The real inference service (its servicer, core, load reports) runs over a backend
that streams one byte-level token per step after ``ttft_ms``, with made-up top-k log
probabilities when asked, so that what is measured through it is the mesh's own cost:
the upstream is never the bottleneck, and it takes no CPU from the engine of a replica it
stands beside (a canary on hardware of its own, say). As in an engine's decode loop, one
step every ``itl_ms`` gives every running sequence its next token at once; under a stream
gap, as in the reference engine, the tokens between two responses stay with the engine,
and the service is woken once per response, not once per step.

Run as ``python -m bench.paced_replica`` with the inference service's settings
(``LLM_MESH_INFERENCE_GRPC_PORT``, ...) and ``LLM_MESH_PACED_TTFT_MS``,
``LLM_MESH_PACED_ITL_MS``, ``LLM_MESH_PACED_MAX_CONTEXT``, ``LLM_MESH_PACED_STREAM_GAP_MS``.
"""

from __future__ import annotations

import asyncio
import math
import os
import random
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

from llmmesh.launcher import Stack, StackPorts
from llmmesh.launcher.process import Child
from llmmesh.runtime import GrpcService, service_main
from llmmesh.runtime.registration import add_servicer
from llmmesh.types import Chunk, FinishReason, InferenceCall, ModelCard, TokenLogprob
from services.inference.config import SERVICE, InferenceConfig
from services.inference.core import InferenceCore
from services.inference.load import LoadMonitor
from services.inference.server import SERVICE as INFERENCE
from services.inference.server import configured_servicer
from services.inference.triton import StreamGap

ALPHABET = "etaoinshrdlu "


class StepClock:
    """An engine's decode steps: every ``itl_s`` while a sequence waits, one tick for all."""

    def __init__(self, itl_s: float) -> None:
        self._itl = itl_s
        self._due: dict[int, asyncio.Event] = {}  # the ticks awaited, by number
        self._ticking: asyncio.Task[None] | None = None
        self.steps = 0

    async def step(self, count: int = 1) -> None:
        """Returns at the ``count``-th tick from now, without waking at those before it."""
        number = self.steps + count
        tick = self._due.get(number)
        if tick is None:
            tick = self._due[number] = asyncio.Event()
        if self._ticking is None or self._ticking.done():
            self._ticking = asyncio.ensure_future(self._run())
        await tick.wait()

    async def _run(self) -> None:
        while self._due:
            await asyncio.sleep(self._itl)  # the simulated decode step
            self.steps += 1
            tick = self._due.pop(self.steps, None)
            if tick is not None:
                tick.set()


class PacedBackend:
    """Tokens on a clock: the first after ``ttft_s``, then one every step of ``itl_s``; with
    a ``gap``, as the reference engine streams when the inference service asks it for one:
    after the first ``gap.after`` responses, a response goes no sooner than ``gap.seconds``
    after the one before, the tokens between together; the last never waits."""

    def __init__(
        self, ttft_s: float, itl_s: float, max_context: int, gap: StreamGap | None = None
    ) -> None:
        self._ttft = ttft_s
        self.clock = StepClock(itl_s)
        self._max_context = max_context
        self._gap = gap or StreamGap()
        # The gap in steps (with no step time, every step is within it: all the rest at once)
        seconds = self._gap.seconds
        self._gap_steps = math.ceil(seconds / itl_s) if itl_s else sys.maxsize
        self.running = 0

    async def describe(self, model: str) -> ModelCard:
        return ModelCard(model, self._max_context)  # byte-level tokens, as the tiny model

    async def generate(self, call: InferenceCall) -> AsyncIterator[Chunk]:
        rng = random.Random(call.sampling.seed)
        total = call.sampling.max_tokens
        self.running += 1
        try:
            await asyncio.sleep(self._ttft)  # the simulated prefill: the first token with it
            made, responses = 0, 0
            while made < total:
                count = self._next_count(responses, total - made)
                if made:
                    await self.clock.step(count)  # a token a step, these together
                made += count
                last = FinishReason.LENGTH if made == total else None
                yield _together(
                    [self._token(rng, call.sampling.logprobs) for _ in range(count)], last
                )
                responses += 1
        finally:
            self.running -= 1

    def _next_count(self, responses: int, left: int) -> int:
        """Tokens in the next response: the first alone; one a step until the gap begins;
        then the steps of a gap's worth (an engine that holds a stream's tokens for the gap
        sends them once it has passed; the relay is not woken at the steps between)."""
        if not responses or not self._gap.seconds or responses < self._gap.after:
            return 1
        return min(self._gap_steps, left)

    def _token(self, rng: random.Random, top: int | None) -> Chunk:
        text = rng.choice(ALPHABET)
        return Chunk(text, 1, None, logprobs=_scored(text, rng, top))


def _together(chunks: list[Chunk], finish: FinishReason | None) -> Chunk:
    """Tokens of consecutive steps as one response."""
    return Chunk(
        "".join(c.text for c in chunks),
        len(chunks),
        finish,
        logprobs=tuple(lp for c in chunks for lp in c.logprobs),
    )


def _scored(text: str, rng: random.Random, top: int | None) -> tuple[TokenLogprob, ...]:
    if top is None:
        return ()
    weights = sorted((rng.random() for _ in range(max(top, 1))), reverse=True)
    norm = sum(weights) * 1.25  # a quarter of the mass outside the top k
    alternatives = tuple(
        (ord(c), c, math.log(w / norm)) for c, w in zip(ALPHABET, weights, strict=False)
    )
    logprob = next((lp for _, t, lp in alternatives if t == text), math.log(0.01))
    return (TokenLogprob(ord(text), text, logprob, 1, alternatives[:top]),)


def start_paced_replica(
    stack: Stack, workdir: Path, ttft_ms: float, itl_ms: float, gap_ms: float = 0.0
) -> tuple[Child, str]:
    """A paced replica of the tiny model beside ``stack`` (its inference settings, its
    credential), on a free port; returns once it serves, with its address."""
    port = StackPorts.free().inference
    env = stack.service_env("inference") | {
        "LLM_MESH_INFERENCE_GRPC_PORT": str(port),
        "LLM_MESH_INFERENCE_METRICS_PORT": "0",
        "LLM_MESH_INFERENCE_MODELS": '["llm"]',
    }
    pace = {"ttft_ms": ttft_ms, "itl_ms": itl_ms, "gap_ms": gap_ms}
    return spawn_paced("bench.paced_replica", port, env, workdir, **pace)


def spawn_paced(
    module: str,
    port: int,
    env: dict[str, str],
    workdir: Path,
    *,
    ttft_ms: float,
    itl_ms: float,
    gap_ms: float,
) -> tuple[Child, str]:
    """``python -m module`` serving on ``port`` over a PacedBackend of these terms; returns
    once it serves, with its address."""
    env = env | {
        "LLM_MESH_PACED_TTFT_MS": str(ttft_ms),
        "LLM_MESH_PACED_ITL_MS": str(itl_ms),
        "LLM_MESH_PACED_STREAM_GAP_MS": str(gap_ms),
    }
    name = f"{module.rsplit('.', 1)[-1]}-{port}"
    child = Child.spawn(name, [sys.executable, "-m", module], env, workdir / f"{name}.log", workdir)
    address = f"127.0.0.1:{port}"
    child.wait_serving(address, time.monotonic() + 60)
    return child, address


def paced_backend() -> PacedBackend:
    """The backend spawn_paced's environment describes. A stream gap (0: none) spares the
    inference service's first ``engine_stream_gap_after`` responses, as it asks the
    engine to."""
    after = InferenceConfig.model_fields["engine_stream_gap_after"].default
    return PacedBackend(
        float(os.environ.get("LLM_MESH_PACED_TTFT_MS", "20")) / 1000,
        float(os.environ.get("LLM_MESH_PACED_ITL_MS", "10")) / 1000,
        int(os.environ.get("LLM_MESH_PACED_MAX_CONTEXT", "2048")),
        StreamGap(float(os.environ.get("LLM_MESH_PACED_STREAM_GAP_MS", "0")) / 1000, after),
    )


def build(config: InferenceConfig) -> GrpcService:
    backend = paced_backend()
    core = InferenceCore(backend, config.max_tokens_limit)
    models = config.models

    async def engine_page() -> str:  # the gauges a Triton engine would publish
        return "\n".join(
            f'llm_engine_running_sequences{{model="{m}"}} {backend.running}' for m in models
        )

    monitor = LoadMonitor(engine_page, lambda: core.in_flight, core.latency)
    servicer = configured_servicer(config, core, monitor)
    service = GrpcService(
        config,
        [INFERENCE.full_name],
        lambda server: add_servicer(server, servicer, INFERENCE),
        cleanup=monitor.close,
    )
    service.on_drain(servicer.drain)
    return service


if __name__ == "__main__":
    service_main(SERVICE, InferenceConfig, build)

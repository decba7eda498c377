"""Shadow traffic: the routing document's ``mirror`` sends a copy of a sampled share of the
requests stable serves to the mirror subset, and compares the two answers.

It wraps the dispatcher, below the router core: a request reaches it only after policy's
verdict on everything the model reads (a prompt the policy denies is never mirrored), and
its shadow is never seen by the core, so it is never charged to the tenant, counted in its
limits or given an admission slot. A mirrored request is sent with a seed (its own, or
one drawn for it: any seed is as good a sample as none) and the top-k log probabilities
of each position, which the client gets only as far as it asked for them; the shadow is
the same call, pinned to the mirror subset, started once stable's answer is complete. At
most ``max_in_flight`` shadows run at once per subset; one more, or one while the fleet is
saturated, is dropped and counted. Every client stream is recorded with its subset for
the latency gates, and every pair's drift for the drift gates (canary_watch.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections import Counter
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field, replace

from llmmesh.analysis.pairs import compare
from llmmesh.runtime.errors import MeshError
from llmmesh.types import SEED_LIMIT, Chunk, InferenceCall, ModelCard, Sampling, TokenLogprob
from services.router.admission import SHADOW_PRIORITY
from services.router.canary_watch import CanaryWatch
from services.router.dispatch import Dispatcher
from services.router.routing import MirrorSpec, PolicyHolder
from services.router.upstreams import RouteHints

log = logging.getLogger(__name__)


@dataclass
class _Answer:
    """A stream as it went by: its text, scored tokens, subset and timing."""

    started: float = field(default_factory=time.monotonic)
    first_at: float | None = None
    parts: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    tokens: int = 0
    subset: str = ""
    fallback: bool = False

    def add(self, chunk: Chunk) -> None:
        if self.first_at is None and chunk.text:
            self.first_at = time.monotonic()
        self.parts.append(chunk.text)
        self.logprobs += chunk.logprobs
        self.tokens += chunk.num_tokens
        if chunk.route is not None:
            self.subset, self.fallback = chunk.route.subset, chunk.route.fallback

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def tpot(self) -> float | None:
        if self.first_at is None or self.tokens < 2:
            return None
        return (time.monotonic() - self.first_at) / (self.tokens - 1)


def _as_asked(chunk: Chunk, sampling: Sampling) -> Chunk:
    """The chunk with only the log probabilities its client asked for (the tokens' own
    entries, which carry their ids, when it asked for those)."""
    if not chunk.logprobs:
        return chunk
    if not sampling.scores_tokens:
        return replace(chunk, logprobs=())
    asked = sampling.logprobs or 0
    return replace(chunk, logprobs=tuple(replace(t, top=t.top[:asked]) for t in chunk.logprobs))


class Mirror:
    """The router's InferenceClient when shadow traffic may be configured."""

    def __init__(
        self,
        inner: Dispatcher,
        routing: PolicyHolder,
        watch: CanaryWatch,
        rng: random.Random | None = None,
    ) -> None:
        self._inner = inner
        self._routing = routing
        self._watch = watch
        self._rng = rng or random.Random()
        self._running: Counter[tuple[str, str]] = Counter()
        self._tasks: set[asyncio.Task[None]] = set()

    def saturated(self, priority: int | None = None) -> bool:
        return self._inner.saturated(priority)

    async def describe(self, model: str) -> ModelCard:
        return await self._inner.describe(model)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def _mirrors(self, hints: RouteHints) -> MirrorSpec | None:
        spec = self._routing.current.mirror
        if spec is None or hints.color or hints.background:  # pinned, or the mesh's own
            return None
        return spec if self._rng.random() * 100 < spec.percent else None

    def _scored(self, call: InferenceCall, spec: MirrorSpec) -> InferenceCall:
        sampling = call.sampling
        seed = sampling.seed if sampling.seed is not None else self._rng.randrange(SEED_LIMIT)
        top = max(spec.top_logprobs, sampling.logprobs or 0)
        return replace(call, sampling=replace(sampling, seed=seed, logprobs=top))

    async def generate(self, call: InferenceCall, hints: RouteHints) -> AsyncGenerator[Chunk, None]:
        spec = self._mirrors(hints)
        sent = self._scored(call, spec) if spec is not None else call
        answer = _Answer()
        async with contextlib.aclosing(self._inner.generate(sent, hints)) as chunks:
            async for chunk in chunks:
                answer.add(chunk)
                if chunk.finish_reason is not None:
                    if not hints.background:
                        self._finished(call.model, answer)
                    if spec is not None:
                        self._mirror(spec, sent, answer)
                yield _as_asked(chunk, call.sampling)

    def _finished(self, model: str, answer: _Answer) -> None:
        if answer.subset and answer.first_at is not None:
            ttft = answer.first_at - answer.started
            self._watch.stream(model, answer.subset, ttft, answer.tpot())

    def _mirror(self, spec: MirrorSpec, call: InferenceCall, stable: _Answer) -> None:
        model, subset = call.model, spec.subset
        if stable.subset == subset or stable.fallback:
            return  # the canary's own request, or stable's served elsewhere
        if self._running[model, subset] >= spec.max_in_flight:
            self._watch.shadow(model, subset, "dropped_full")
            return
        if self._inner.saturated():
            self._watch.shadow(model, subset, "dropped_saturated")
            return
        self._running[model, subset] += 1
        task = asyncio.create_task(self._shadow(subset, call, stable))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _shadow(self, subset: str, call: InferenceCall, stable: _Answer) -> None:
        model, outcome = call.model, "failed"
        # What the two say is compared, not how each scores the prompt: computing it whole
        # again on the canary would be wasted.
        unscored = call.sampling.without_prompt_reports()
        shadow = replace(call, request_id=f"{call.request_id}.shadow", sampling=unscored)
        if call.priority is not None:  # never before a client's request in the engine
            shadow = replace(shadow, priority=SHADOW_PRIORITY)
        hints = RouteHints(color=subset, tier="shadow")
        answer = _Answer()
        try:
            async with contextlib.aclosing(self._inner.generate(shadow, hints)) as chunks:
                async for chunk in chunks:
                    answer.add(chunk)
            if answer.subset != subset:
                outcome = "served_elsewhere"
            else:
                diff = compare(stable.logprobs, answer.logprobs, stable.text, answer.text)
                self._watch.pair(model, subset, diff)
                outcome = "compared"
        except MeshError as err:
            # Its kind, not its message: a refusal's message may quote the request.
            log.info("a shadow failed", extra={"fields": {"subset": subset, "error": err.code}})
        finally:
            self._running[model, subset] -= 1
            self._watch.shadow(model, subset, outcome)

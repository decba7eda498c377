"""Scorers: how good each remaining replica is for the request, in [0, 1].

The load scorers are linear: ``1 - x / scale``, clipped at 0, where ``x`` is the signal
(queued requests, running sequences, KV use, streams not yet reported, prefill tokens),
so that their weighted sum ranks replicas by a weighted load cost, as far as ``scale``
reaches: trading 250 tokens of prefill against three running sequences works the same at
any load. Session affinity keeps a conversation on its replica until that one is
saturated.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

from pydantic import Field

from services.router.scheduling.plugins import Params, Scorer, register
from services.router.scheduling.types import Candidate, PickContext


class Scale(Params):
    scale: float = Field(default=1.0, gt=0)  # the signal at which the score reaches 0


class LinearScorer(Scorer):
    """``1 - signal / scale``, clipped to [0, 1]."""

    Settings = Scale
    signal: Callable[[PickContext, Candidate], float]

    def score(self, ctx: PickContext, candidates: Sequence[Candidate]) -> list[float]:
        assert isinstance(self.params, Scale)
        scale, signal = self.params.scale, type(self).signal
        return [max(0.0, 1.0 - signal(ctx, c) / scale) for c in candidates]


class QueueScale(Scale):
    scale: float = Field(default=64, gt=0)


@register("queue")
class Queue(LinearScorer):
    """Requests queued in the engine: a request sent there waits for a slot."""

    Settings = QueueScale

    @staticmethod
    def signal(ctx: PickContext, c: Candidate) -> float:
        return c.waiting


class RunningScale(Scale):
    scale: float = Field(default=256, gt=0)


@register("running")
class Running(LinearScorer):
    """Sequences the engine runs (less those this router ended since the report)."""

    Settings = RunningScale

    @staticmethod
    def signal(ctx: PickContext, c: Candidate) -> float:
        return c.running


@register("kv_utilization")
class KvUtilization(LinearScorer):
    """The engine's KV cache in use: a full one means preemption or waiting."""

    @staticmethod
    def signal(ctx: PickContext, c: Candidate) -> float:
        return c.kv_utilization


class PendingScale(Scale):
    scale: float = Field(default=64, gt=0)


@register("pending")
class Pending(LinearScorer):
    """Streams this router opened that the replica's last report does not show yet."""

    Settings = PendingScale

    @staticmethod
    def signal(ctx: PickContext, c: Candidate) -> float:
        return c.unseen


class PrefillScale(Scale):
    scale: float = Field(default=64_000, gt=0)  # prompt tokens


@register("prefill")
class Prefill(LinearScorer):
    """Prefill the replica has to do: prompt tokens this router sent that await their
    first token, plus this prompt's tokens its prefix cache likely lacks."""

    Settings = PrefillScale
    reason = "prefix"

    @staticmethod
    def signal(ctx: PickContext, c: Candidate) -> float:
        return c.prefilling + ctx.uncached_tokens(c)

    def explains(self, ctx: PickContext, chosen: Candidate) -> bool:
        return bool(ctx.matched.get(chosen.address))


class AffinityParams(Params):
    # Saturated, beyond a queue or a full cache: this many more streams (running,
    # queued, not yet reported) than the least busy candidate.
    excess_load: float = Field(default=4.0, gt=0)


class PrefixAffinityParams(AffinityParams):
    # The share of the prompt's blocks a replica must have been sent already for the
    # prompt to count as the continuation of what it serves (SGLang's and vLLM's
    # routers match on a share of the prompt the same way).
    min_share: float = Field(default=0.5, gt=0, le=1)


def _busy(c: Candidate) -> float:
    """Streams on the replica: running, queued, and sent since its report."""
    return c.running + c.waiting + c.unseen


class Affinity(Scorer):
    """1 for the replicas a request belongs on, unless saturated: a queue, a full cache,
    or ``excess_load`` more streams than the least busy candidate."""

    Settings = AffinityParams

    def homes(self, ctx: PickContext) -> Collection[str]:
        raise NotImplementedError

    def score(self, ctx: PickContext, candidates: Sequence[Candidate]) -> list[float]:
        homes = self.homes(ctx)
        if not homes:
            return [0.0] * len(candidates)
        assert isinstance(self.params, AffinityParams)
        least = min(_busy(c) for c in candidates)
        scores = [
            1.0
            if c.address in homes
            and not ctx.saturated(c)
            and _busy(c) - least <= self.params.excess_load
            else 0.0
            for c in candidates
        ]
        ctx.notes[self.reason] = {c.address for c, s in zip(candidates, scores, strict=True) if s}
        return scores

    def explains(self, ctx: PickContext, chosen: Candidate) -> bool:
        return chosen.address in ctx.notes.get(self.reason, ())


@register("session_affinity")
class SessionAffinity(Affinity):
    """The replica serving the request's conversation (its session)."""

    reason = "affinity"

    def homes(self, ctx: PickContext) -> Collection[str]:
        key = ctx.request.session_key
        home = ctx.state.sessions.get(key) if key else None
        return (home,) if home is not None else ()


@register("prefix_affinity")
class PrefixAffinity(Affinity):
    """The replicas that were sent the longest prefix of the prompt, when that prefix is
    at least ``min_share`` of it: a conversation whose client resends it whole (no
    session id) stays where its history is cached, as a session does. Prefill on this
    kind of engine costs far more than the running sequences a busier replica adds (1000
    uncached tokens: about 380 ms of prefill; a running sequence: about 1.5 ms of a
    newcomer's TTFT), which the prefill scorer alone weighs only against load."""

    Settings = PrefixAffinityParams
    reason = "prefix"

    def homes(self, ctx: PickContext) -> Collection[str]:
        blocks = len(ctx.request.prefix)
        longest = max(ctx.matched.values(), default=0)
        assert isinstance(self.params, PrefixAffinityParams)
        if not blocks or longest < self.params.min_share * blocks:
            return ()
        return {address for address, n in ctx.matched.items() if n == longest}


class DevicePackingParams(Params):
    # Engines one device runs at once without slowing each other: one for a GPU; for
    # CPUs, the CPUs over each engine's threads.
    engines_at_once: int = Field(default=1, ge=1)
    # Streams an engine takes before another engine of its device is worth starting.
    fill: float = Field(default=8.0, gt=0)


@register("device_packing")
class DevicePacking(Scorer):
    """Replicas that share a device (``Endpoint.device``) fill a few engines' batches
    before more of them start: engines time-sliced on one device each run slower, and a
    batched step costs far less per token than a step of one sequence. Of a device's
    candidates, its ``engines_at_once`` busiest score 1 and the rest 0 while one of those
    has room under ``fill``; once all are full, every one scores 1 and the load scorers
    spread. A replica with a device of its own (or none named) always scores 1."""

    Settings = DevicePackingParams

    def score(self, ctx: PickContext, candidates: Sequence[Candidate]) -> list[float]:
        assert isinstance(self.params, DevicePackingParams)
        by_device: dict[str, list[Candidate]] = {}
        for c in candidates:
            if c.endpoint.device:
                by_device.setdefault(c.endpoint.device, []).append(c)
        held_back: set[str] = set()
        for peers in by_device.values():
            ranked = sorted(peers, key=lambda c: (-_busy(c), c.address))
            active = ranked[: self.params.engines_at_once]
            if any(_busy(c) < self.params.fill for c in active):
                held_back.update(c.address for c in ranked[len(active) :])
        return [0.0 if c.address in held_back else 1.0 for c in candidates]

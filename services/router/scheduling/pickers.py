"""Pickers: the replica, from the scores."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING

from services.router.scheduling.plugins import Params, Picker, register
from services.router.scheduling.types import Candidate, PickContext

if TYPE_CHECKING:
    from services.router.routing import RoutingPolicy


@register("best_score")
class BestScore(Picker):
    """The highest weighted score; ties at random."""

    reason = "load"

    def pick(
        self, ctx: PickContext, candidates: Sequence[Candidate], scores: Sequence[float]
    ) -> Candidate:
        best = max(scores)
        return ctx.state.rng.choice(
            [c for c, s in zip(candidates, scores, strict=True) if s == best]
        )


@register("round_robin")
class RoundRobin(Picker):
    """Takes turns, blind to load: the baseline the other pickers are measured against."""

    reason = "round_robin"

    def __init__(self, params: Params, policy: RoutingPolicy) -> None:
        super().__init__(params, policy)
        self._turn = itertools.count()

    def pick(
        self, ctx: PickContext, candidates: Sequence[Candidate], scores: Sequence[float]
    ) -> Candidate:
        ordered = sorted(candidates, key=lambda c: c.address)
        return ordered[next(self._turn) % len(ordered)]

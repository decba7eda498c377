"""The scheduler: a request through the profile's filters, scorers and picker."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from llmmesh.runtime.errors import Unavailable
from services.router.affinity import PrefixIndex, SessionTable
from services.router.scheduling.filters import check_color
from services.router.scheduling.plugins import NoCandidates
from services.router.scheduling.profile import (
    Profile,
    SchedulingSpec,
    build_profile,
    legacy_spec,
)
from services.router.scheduling.types import (
    Candidate,
    Decision,
    PickContext,
    Picked,
    PickRequest,
    SchedulingState,
)

if TYPE_CHECKING:
    from services.router.routing import RoutingPolicy

# The reason of a pick among one candidate the filters left: nothing to weigh.
ONLY_CANDIDATE = "only_candidate"


class Scheduler:
    """Picks a replica per request with the routing document's profile (built once per
    document), and remembers where sessions and prompt prefixes went."""

    def __init__(self, state: SchedulingState, default: SchedulingSpec | None = None) -> None:
        self.state = state
        self._default = default  # for documents that name no profile (RouterConfig)
        self._built: tuple[RoutingPolicy, Profile] | None = None

    @property
    def prefixes(self) -> PrefixIndex:
        return self.state.prefixes

    @property
    def sessions(self) -> SessionTable:
        return self.state.sessions

    def profile(self, policy: RoutingPolicy) -> Profile:
        if self._built is None or self._built[0] is not policy:
            spec = policy.scheduling or self._default or legacy_spec(policy)
            self._built = (policy, build_profile(spec, policy))
        return self._built[1]

    def pick(
        self, request: PickRequest, candidates: Sequence[Candidate], policy: RoutingPolicy
    ) -> Decision:
        profile = self.profile(policy)
        check_color(request, policy, candidates)
        ctx = PickContext(
            request, self.state, policy.saturation.waiting, policy.saturation.kv_utilization
        )
        if request.prefix:
            ctx.matched = self.state.prefixes.matched_blocks(list(request.prefix))
        remaining = self._filtered(profile, ctx, list(candidates))
        if len(remaining) == 1:  # nothing to weigh (and scoring costs a cold path ~0.1 ms)
            chosen, why = remaining[0], ONLY_CANDIDATE
        else:
            chosen, why = self._weighed(profile, ctx, remaining)
        subset = ctx.subset or chosen.endpoint.version
        picked = Picked(chosen.address, subset, request.session_key, request.prefix)
        self.state.learn(picked)
        if self.state.on_pick is not None:
            self.state.on_pick(picked)
        return Decision(chosen, ctx.uncached_tokens(chosen), subset, (*ctx.reasons, why))

    @staticmethod
    def _weighed(
        profile: Profile, ctx: PickContext, remaining: list[Candidate]
    ) -> tuple[Candidate, str]:
        """The picker's choice by the weighted scores, and the reason that explains it."""
        totals = [0.0] * len(remaining)
        for scorer, weight in profile.scorers:
            for i, score in enumerate(scorer.score(ctx, remaining)):
                totals[i] += weight * score
        chosen = profile.picker.pick(ctx, remaining, totals)
        why = next(
            (s.reason for s, _ in profile.scorers if s.reason and s.explains(ctx, chosen)),
            profile.picker.reason,
        )
        return chosen, why

    @staticmethod
    def _filtered(
        profile: Profile, ctx: PickContext, remaining: list[Candidate]
    ) -> list[Candidate]:
        try:
            for plugin in profile.filters:
                remaining = plugin.filter(ctx, remaining)
                if not remaining:
                    raise NoCandidates(f"no healthy replica of model '{ctx.request.model}'")
        except NoCandidates as err:
            raise Unavailable(str(err)) from None
        return remaining

"""Filters: which replicas may serve the request at all, and which of them first."""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from llmmesh.runtime.errors import InvalidArgument
from services.router.scheduling.plugins import Filter, NoCandidates, register
from services.router.scheduling.types import Candidate, PickContext, PickRequest

if TYPE_CHECKING:
    from services.router.routing import RoutingPolicy


@register("healthy")
class Healthy(Filter):
    """Replicas that serve the model, whose breaker lets requests in and whose load
    reports are fresh."""

    def filter(self, ctx: PickContext, candidates: list[Candidate]) -> list[Candidate]:
        model = ctx.request.model
        return [c for c in candidates if c.healthy and c.endpoint.serves(model)]


@register("retry_elsewhere")
class RetryElsewhere(Filter):
    """A retried request avoids the replicas it failed on, unless no other is left."""

    def filter(self, ctx: PickContext, candidates: list[Candidate]) -> list[Candidate]:
        avoid = ctx.request.avoid
        return [c for c in candidates if c.address not in avoid] or candidates


def split_point(session_key: str, rng: random.Random) -> float:
    """The request's position on the split: from the session when it has one."""
    if not session_key:
        return rng.random()
    digest = hashlib.blake2b(session_key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


def check_color(
    request: PickRequest, policy: RoutingPolicy, candidates: Sequence[Candidate]
) -> None:
    """InvalidArgument naming the color header when its subset is none the routing
    document names and none of the model's replicas (healthy or not) is: the client's
    mistake, not an outage (a client would retry a 503)."""
    if not request.color:
        return
    subset = policy.colors.get(request.color, request.color)
    known = {*policy.split, *policy.colors.values(), *policy.fallback}
    known.update(subset for order in policy.fallback.values() for subset in order)
    known.update(c.endpoint.version for c in candidates if c.endpoint.serves(request.model))
    if subset not in known:
        raise InvalidArgument(
            "x-llm-color", f"{request.color!r} names no subset of model '{request.model}'"
        )


def subset_order(
    request: PickRequest, policy: RoutingPolicy, session_subset: str | None = None
) -> tuple[list[str | None], str]:
    """Subsets to try in order (None: any), and why the first was chosen: the color pins
    one; a conversation keeps the subset it talked to while that still has weight; else
    the split draws one by weight (the other weighted subsets fall back)."""
    if request.color:
        return [policy.colors.get(request.color, request.color)], "color"
    weighted = [(s, w) for s, w in policy.split.items() if w > 0]
    if not weighted:
        return [None], "any"
    total = sum(w for _, w in weighted)
    point, chosen = request.split_point * total, weighted[-1][0]
    for subset, weight in weighted:
        if point < weight:
            chosen = subset
            break
        point -= weight
    if session_subset and policy.split.get(session_subset, 0) > 0:
        chosen = session_subset  # a weight change does not move a conversation mid-way
    if chosen in policy.fallback:
        return [chosen, *policy.fallback[chosen]], "split"
    fallbacks = sorted((s for s, _ in weighted if s != chosen), key=lambda s: -policy.split[s])
    return [chosen, *fallbacks], "split"


@register("subset")
class Subset(Filter):
    """The traffic color's subset, or the canary split's draw (a session's from its hash,
    so a conversation stays on one version), falling back to the routing document's
    fallback subsets for it, or else to the other weighted subsets in weight order."""

    def filter(self, ctx: PickContext, candidates: list[Candidate]) -> list[Candidate]:
        key = ctx.request.session_key
        subsets, why = subset_order(
            ctx.request, self.policy, ctx.state.sessions.subset(key) if key else None
        )
        for n, subset in enumerate(subsets):
            chosen = [c for c in candidates if subset is None or c.endpoint.version == subset]
            if chosen:
                ctx.subset = subset
                ctx.reasons += [why] if n == 0 else [why, "fallback"]
                return chosen
        wanted = "any subset" if subsets == [None] else f"subset {subsets[0]!r}"
        raise NoCandidates(f"no healthy replica of model '{ctx.request.model}' in {wanted}")


def region_order(local: str, failover: Sequence[str], present: Iterable[str]) -> list[str]:
    order = [local, *(r for r in failover if r != local)]
    return order + sorted(set(present) - set(order))


@register("region")
class Region(Filter):
    """The router's own region, then the document's failover order, then any other."""

    def filter(self, ctx: PickContext, candidates: list[Candidate]) -> list[Candidate]:
        local = ctx.state.local_region
        order = region_order(local, self.policy.regions, (c.region for c in candidates))
        region = next((r for r in order if any(c.region == r for c in candidates)), None)
        if region is None:
            return []
        if region != local:
            ctx.reasons.append("failover")
        return [c for c in candidates if c.region == region]

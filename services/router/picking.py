"""Endpoint picking: which inference replica serves a request.

A pipeline of small steps, each a function of its inputs:

1. subset: ``x-llm-color`` pins one; otherwise the canary split draws one by weight
   (from the session's hash when there is a session, so a conversation stays put), with
   the other weighted subsets as fallbacks;
2. health: replicas whose breaker is open or whose load report went stale are dropped;
3. region: the router's own region first, then the document's failover order;
4. score and pick: ``llm_aware`` (session affinity until saturated, else queue depth, KV
   use and likely prefix-cache hits) or the ``round_robin`` baseline; ties at random.
"""

from __future__ import annotations

import hashlib
import itertools
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from llmmesh.runtime.errors import Unavailable
from services.router.affinity import BLOCK_CHARS, PrefixIndex, SessionTable
from services.router.endpoints import Endpoint
from services.router.routing import RoutingPolicy, Saturation, ScorerWeights


@dataclass(frozen=True)
class ReportedLoad:
    """A replica's engine load for one model, as its last load report gave it."""

    running: int = 0
    waiting: int = 0
    kv_utilization: float = 0.0


@dataclass(frozen=True)
class Candidate:
    """A replica as the picker sees it for one request."""

    endpoint: Endpoint
    region: str  # the endpoint's region, or the router's own when it names none
    in_flight: int = 0  # streams this router has open to it
    ended: int = 0  # streams this router ended since the report, which may still count them
    # Prompt tokens this router sent it that still await their first token (prefill work
    # queued or running there: an uncached long prompt delays everything behind it).
    prefilling: int = 0
    report: ReportedLoad | None = None  # None: no fresh report for this model
    healthy: bool = True  # breaker closed (or probing) and reports fresh

    @property
    def address(self) -> str:
        return self.endpoint.address


@dataclass(frozen=True)
class PickRequest:
    model: str
    prefix: Sequence[int] = ()  # prefix_hashes() of the prompt
    prompt_chars: int = 0
    session_key: str = ""
    color: str = ""
    # Where in [0, 1) the request falls on the canary split; fixed for a request's retries.
    split_point: float = 0.0
    avoid: frozenset[str] = frozenset()  # replicas that already failed this request


@dataclass(frozen=True)
class Decision:
    candidate: Candidate
    uncached_tokens: int  # prefill the replica likely has to do for this prompt
    subset: str
    reasons: tuple[str, ...]  # color | split | any, then failover, then affinity | prefix | load


def split_point(session_key: str, rng: random.Random) -> float:
    """The request's position on the split: from the session when it has one."""
    if not session_key:
        return rng.random()
    digest = hashlib.blake2b(session_key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


def subset_order(request: PickRequest, policy: RoutingPolicy) -> tuple[list[str | None], str]:
    """Subsets to try in order (None: any), and why the first was chosen."""
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
    fallbacks = sorted((s for s, _ in weighted if s != chosen), key=lambda s: -policy.split[s])
    return [chosen, *fallbacks], "split"


def region_order(local: str, failover: Sequence[str], present: Iterable[str]) -> list[str]:
    order = [local, *(r for r in failover if r != local)]
    return order + sorted(set(present) - set(order))


def load_cost(c: Candidate, w: ScorerWeights) -> float:
    r = c.report
    queued_prefill = w.prefill * c.prefilling / 1000
    if r is None:  # only the router's own view
        return w.running * c.in_flight + queued_prefill
    running = max(0, r.running - c.ended)
    # Streams this router opened that the report does not show yet (sent after it).
    unseen = max(0, c.in_flight - running - r.waiting)
    return (
        w.waiting * r.waiting
        + w.running * running
        + w.kv_utilization * r.kv_utilization
        + w.pending * unseen
        + queued_prefill
    )


def saturated(c: Candidate, s: Saturation, least_load: float, w: ScorerWeights) -> bool:
    r = c.report
    if r is not None and (r.waiting >= s.waiting or r.kv_utilization >= s.kv_utilization):
        return True
    return load_cost(c, w) - least_load > s.excess_load


def uncached_tokens(prompt_chars: int, matched_blocks: int) -> int:
    """Prompt tokens (characters, approximately) not covered by the cached prefix."""
    return max(0, prompt_chars - matched_blocks * BLOCK_CHARS)


@dataclass
class Picker:
    """Runs the pipeline; remembers sessions and prefixes for the llm_aware algorithm."""

    local_region: str
    rng: random.Random = field(default_factory=random.Random)
    prefixes: PrefixIndex = field(default_factory=PrefixIndex)
    sessions: SessionTable = field(default_factory=SessionTable)
    _turn: itertools.count[int] = field(default_factory=itertools.count)

    def pick(
        self, request: PickRequest, candidates: Sequence[Candidate], policy: RoutingPolicy
    ) -> Decision:
        serving = [c for c in candidates if c.healthy and c.endpoint.serves(request.model)]
        preferred = [c for c in serving if c.address not in request.avoid] or serving
        subsets, why = subset_order(request, policy)
        for n, subset in enumerate(subsets):
            pool = [c for c in preferred if subset is None or c.endpoint.version == subset]
            if pool:
                reasons = (why,) if n == 0 else (why, "fallback")
                return self._in_region(request, pool, policy, subset, reasons)
        wanted = "any subset" if subsets == [None] else f"subset {subsets[0]!r}"
        raise Unavailable(f"no healthy replica of model '{request.model}' in {wanted}")

    def _in_region(
        self,
        request: PickRequest,
        pool: list[Candidate],
        policy: RoutingPolicy,
        subset: str | None,
        reasons: tuple[str, ...],
    ) -> Decision:
        order = region_order(self.local_region, policy.regions, (c.region for c in pool))
        region = next(r for r in order if any(c.region == r for c in pool))
        if region != self.local_region:
            reasons = (*reasons, "failover")
        local = [c for c in pool if c.region == region]
        matched = self.prefixes.matched_blocks(list(request.prefix)) if request.prefix else {}
        if policy.algorithm == "round_robin":
            local.sort(key=lambda c: c.address)
            chosen, why = local[next(self._turn) % len(local)], "round_robin"
        else:
            chosen, why = self._llm_aware(request, local, policy, matched)
        if request.session_key:
            self.sessions.set(request.session_key, chosen.address)
        self.prefixes.record(request.prefix, chosen.address)
        uncached = uncached_tokens(request.prompt_chars, matched.get(chosen.address, 0))
        return Decision(chosen, uncached, subset or chosen.endpoint.version, (*reasons, why))

    def _llm_aware(
        self,
        request: PickRequest,
        pool: list[Candidate],
        policy: RoutingPolicy,
        matched: dict[str, int],
    ) -> tuple[Candidate, str]:
        w = policy.weights
        loads = [load_cost(c, w) for c in pool]
        sticky = self.sessions.get(request.session_key) if request.session_key else None
        for c in pool:
            if c.address == sticky and not saturated(c, policy.saturation, min(loads), w):
                return c, "affinity"
        costs = [
            load
            + w.prefill * uncached_tokens(request.prompt_chars, matched.get(c.address, 0)) / 1000
            for c, load in zip(pool, loads, strict=True)
        ]
        best = min(costs)
        chosen = self.rng.choice([c for c, cost in zip(pool, costs, strict=True) if cost == best])
        return chosen, "prefix" if matched.get(chosen.address) else "load"

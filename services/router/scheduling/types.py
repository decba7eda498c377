"""What scheduling works on: the request, the candidate replicas, the decision."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from services.router.affinity import BLOCK_CHARS, PrefixIndex, SessionTable
from services.router.endpoints import Endpoint


@dataclass(frozen=True)
class Candidate:
    """A replica as scheduling sees it for one request."""

    endpoint: Endpoint
    region: str  # the endpoint's region, or the router's own when it names none
    in_flight: int = 0  # streams this router has open to it
    ended: int = 0  # streams this router ended since the report, which may still count them
    # Prompt tokens this router sent it that still await their first token (prefill work
    # queued or running there: an uncached long prompt delays everything behind it).
    prefilling: int = 0
    # The engine's load for this model as the replica last reported it (running, waiting,
    # kv_utilization, and whatever else the engine exports); None: no fresh report.
    load: Mapping[str, float] | None = None
    healthy: bool = True  # breaker closed (or probing) and reports fresh

    @property
    def address(self) -> str:
        return self.endpoint.address

    def metric(self, name: str) -> float:
        return self.load.get(name, 0.0) if self.load is not None else 0.0

    @property
    def running(self) -> int:
        """Sequences it runs that this router has not ended since the report."""
        return max(0, int(self.metric("running")) - self.ended)

    @property
    def unseen(self) -> int:
        """Streams this router opened that the last report does not show yet."""
        if self.load is None:
            return self.in_flight
        return max(0, self.in_flight - self.running - int(self.metric("waiting")))


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
    reasons: tuple[str, ...]  # color | split | any, then fallback, failover, then why


@dataclass
class SchedulingState:
    """What scheduling remembers between requests."""

    local_region: str
    rng: random.Random = field(default_factory=random.Random)
    prefixes: PrefixIndex = field(default_factory=PrefixIndex)
    sessions: SessionTable = field(default_factory=SessionTable)


@dataclass
class PickContext:
    """One request's way through the plugins: what they share and what they found."""

    request: PickRequest
    state: SchedulingState
    saturation_waiting: int
    saturation_kv: float
    subset: str | None = None  # the subset the subset filter chose (None: any)
    reasons: list[str] = field(default_factory=list)
    matched: dict[str, int] = field(default_factory=dict)  # replica -> cached prefix blocks
    notes: dict[str, Any] = field(default_factory=dict)  # what a plugin leaves for itself

    def uncached_tokens(self, candidate: Candidate) -> int:
        """Prompt tokens (characters, approximately) not covered by its cached prefix."""
        cached = self.matched.get(candidate.address, 0) * BLOCK_CHARS
        return max(0, self.request.prompt_chars - cached)

    def saturated(self, candidate: Candidate) -> bool:
        """Its engine queues requests or its cache is nearly full."""
        return (
            candidate.metric("waiting") >= self.saturation_waiting
            or candidate.metric("kv_utilization") >= self.saturation_kv
        )

"""What scheduling works on: the request, the candidate replicas, the decision."""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from services.router.affinity import BLOCK_CHARS, PrefixIndex, SessionTable
from services.router.endpoints import Endpoint

# A load report's engine queue by scheduling priority: one metric per priority, this
# prefix and the priority (``waiting_sequences_by_priority.2``).
WAITING_BY_PRIORITY = "waiting_sequences_by_priority."


def waiting_as_urgent(load: Mapping[str, float], priority: int | None) -> float:
    """Sequences an engine's report says wait at ``priority`` or more urgent ones; all
    that wait when ``priority`` is None or the engine does not report them by priority."""
    if priority is None:
        return load.get("waiting", 0)
    found, total = False, 0.0
    for key, value in load.items():
        if key.startswith(WAITING_BY_PRIORITY):
            found = True
            if int(key[len(WAITING_BY_PRIORITY) :]) <= priority:
                total += value
    return total if found else load.get("waiting", 0)


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
    # The request's engine scheduling priority (None: it has none, or the engines do not
    # order by it): with one, only the queue at that priority or more urgent is ahead of it
    # (the engine runs it before the rest, or preempts the rest for it).
    priority: int | None = None

    # Derived once from the fields above, since every scorer reads them for every
    # candidate: its address, running (sequences it runs that this router has not ended since the
    # report), waiting (queued in its engine ahead of the request), kv_utilization, and
    # unseen (streams this router opened that the last report does not show yet).
    address: str = field(init=False)
    running: int = field(init=False)
    waiting: float = field(init=False)
    kv_utilization: float = field(init=False)
    unseen: int = field(init=False)

    def __post_init__(self) -> None:
        load = self.load or {}
        queued = load.get("waiting", 0.0)
        running = max(0, int(load.get("running", 0.0)) - self.ended)
        if self.load is None:
            unseen = self.in_flight
        else:
            unseen = max(0, self.in_flight - running - int(queued))
        for name, value in (
            ("address", self.endpoint.address),
            ("running", running),
            ("waiting", waiting_as_urgent(load, self.priority)),
            ("kv_utilization", load.get("kv_utilization", 0.0)),
            ("unseen", unseen),
        ):
            object.__setattr__(self, name, value)

    def metric(self, name: str) -> float:
        return self.load.get(name, 0.0) if self.load is not None else 0.0


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
    priority: int | None = None  # its engine scheduling priority (None: none)


@dataclass(frozen=True)
class Decision:
    candidate: Candidate
    uncached_tokens: int  # prefill the replica likely has to do for this prompt
    subset: str
    reasons: tuple[str, ...]  # color | split | any, then fallback, failover, then why

    @property
    def fallback(self) -> bool:
        return "fallback" in self.reasons


@dataclass(frozen=True)
class Picked:
    """Where one request went: what the other routers of a fleet learn of each pick."""

    address: str
    subset: str
    session_key: str = ""
    prefix: Sequence[int] = ()


@dataclass
class SchedulingState:
    """What scheduling remembers between requests."""

    local_region: str
    rng: random.Random = field(default_factory=random.Random)
    prefixes: PrefixIndex = field(default_factory=PrefixIndex)
    sessions: SessionTable = field(default_factory=SessionTable)
    # Told of every pick, to share it (services/router/shared/sync.py); None: one router.
    on_pick: Callable[[Picked], None] | None = None

    def learn(self, picked: Picked) -> None:
        """A pick, this router's or another's: where the session and the prefix went."""
        if picked.session_key:
            self.sessions.set(picked.session_key, picked.address, picked.subset)
        self.prefixes.record(picked.prefix, picked.address)


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
            candidate.waiting >= self.saturation_waiting
            or candidate.kv_utilization >= self.saturation_kv
        )

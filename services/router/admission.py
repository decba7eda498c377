"""Admission: a concurrency window over the fleet, and a queue in front of it.

Requests beyond the window wait for a slot: strict priority between tiers; between the
tenants of a tier, the one served the fewest tokens goes first (a virtual token counter,
as in "Fairness in Serving Large Language Models", OSDI '24); within a tenant, the
earliest deadline first while the queue moves, the newest first once it stands (its
oldest has waited most of its target: in arrival order, every later request would be
late too). The window adapts (AIMD): it grows while requests get their
first token within their tier's target and shrinks when they do not (once per round of
requests), so the engines stay busy without the queue moving into them. Lower tiers
leave free the slots the higher tiers' recent traffic is expected to need, and a share
of the window too unless the engines preempt by priority. When the fleet is saturated,
``sheddable`` requests are refused at once, ``standard`` ones when their wait would
exceed their tier's bound, and ``critical`` ones only when their deadline cannot be met.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prometheus_client import Counter, Gauge, Histogram
from pydantic import BaseModel, ConfigDict, Field

from llmmesh.runtime.errors import DeadlineExceeded, ResourceExhausted
from services.router.demand import RecentEvents, TierDemand

TIERS = ("critical", "standard", "sheddable")  # highest priority first
# The engine's scheduling priority of each tier (lower is more urgent, as vLLM and Triton
# order them), and of a mirrored request, which must never displace a client's.
TIER_PRIORITY = {"critical": 0, "standard": 1, "sheddable": 2}
SHADOW_PRIORITY = 3
RATE_WINDOW_S = 10.0  # the queue's pace: releases over this window

# Every admission outcome, from tenant checks (model_denied, over_budget) to the queue
# (admitted, shed, deadline).
ADMISSION_OUTCOMES = Counter(
    "llm_router_admission_total", "Admission outcomes", ["tenant", "tier", "outcome"]
)
QUEUED = Gauge("llm_router_queued_requests", "Requests waiting for a slot", ["tier"])
QUEUE_WAIT = Histogram(
    "llm_router_queue_wait_seconds",
    "Time from arrival to a slot",
    ["tier"],
    buckets=(0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
LIMIT = Gauge("llm_router_concurrency_limit", "The adaptive concurrency window")
ADMITTED = Gauge("llm_router_admitted_requests", "Requests holding a slot of the window", ["tier"])


def _per_tier(critical: float, standard: float, sheddable: float) -> Any:
    return Field(
        default_factory=lambda: {"critical": critical, "standard": standard, "sheddable": sheddable}
    )


class AdmissionSettings(BaseModel):
    """The concurrency window's bounds and the tiers' targets (RouterConfig.admission)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # The window over the fleet adapts between these bounds.
    initial_limit: float = Field(default=32, ge=1)
    min_limit: float = Field(default=4, ge=1)
    max_limit: float = Field(default=256, ge=1)
    decrease: float = Field(default=0.9, gt=0, lt=1)  # multiplicative, on a missed target
    # Per tier: the first-token target, and the longest a request may wait in the queue.
    ttft_target_s: dict[str, float] = _per_tier(0.5, 1.0, 2.0)
    max_queue_wait_s: dict[str, float] = _per_tier(30.0, 2.0, 1.0)
    # Per tier: a tenant's queue stands once its oldest request has waited this share of
    # the tier's first-token target; its requests are then let in newest first (adaptive
    # LIFO), those that can still be on time before those that cannot, and the oldest
    # wait out their bound. 0: never (critical: every request counts, in deadline order).
    newest_first_after: dict[str, float] = _per_tier(0.0, 0.5, 0.25)
    # Share of the window a tier may fill: what the lower tiers leave free is headroom for
    # higher ones (a slot, once given, is held for a whole generation).
    window_share: dict[str, float] = _per_tier(1.0, 0.8, 0.5)
    # The engines order and preempt by each request's priority (its tier): the reference
    # engine does, and vLLM with --scheduling-policy priority. No tier share then (a
    # lower tier's slot is the engine's to take back), but the slots the higher tiers'
    # recent traffic is about to take stay free (each would be a preemption); the window,
    # the queue's strict priority and shedding stay for what the engines cannot absorb.
    # False: the tier shares apply, and requests go to the engines without a priority.
    # While a higher tier is about, lower tiers go on only while some engine has no queue
    # (a report's ``waiting``, the routing document's saturation).
    engine_priority: bool = True


@dataclass(eq=False)
class Ticket:
    tenant: str
    tier: str
    cost: int  # tokens the request may use: its virtual-counter charge
    deadline: float  # monotonic
    order: int
    arrived: float
    granted: asyncio.Future[None]
    granted_at: float = 0.0  # monotonic


class Slot:
    """A granted place in the window; released once, with when its first token came."""

    def __init__(self, queue: AdmissionQueue, ticket: Ticket) -> None:
        self._queue = queue
        self.ticket = ticket
        self._released = False

    def release(self, first_token_at: float | None) -> None:
        """``first_token_at``: time.monotonic() of the first token, None if there was none."""
        if not self._released:
            self._released = True
            self._queue.release(self.ticket, first_token_at)


class AdmissionQueue:
    def __init__(
        self,
        settings: AdmissionSettings | None = None,
        saturated: Callable[[int | None], bool] = lambda priority: False,
        clock: Callable[[], float] = time.monotonic,
        running_slots: Callable[[], float] = lambda: 0.0,
    ) -> None:
        self.settings = settings or AdmissionSettings()
        # Whether every engine queues work (at a priority or more urgent; None: any).
        self._saturated = saturated
        self._running_slots = running_slots  # the fleet's engines' (0: not reported)
        self._clock = clock
        self.limit = self.settings.initial_limit
        self.in_flight = 0
        self._in_flight_by_tier: dict[str, int] = dict.fromkeys(TIERS, 0)
        self._waiting: dict[str, dict[str, list[Ticket]]] = {t: {} for t in TIERS}
        self._served: dict[str, float] = {}  # tenant -> virtual token counter
        self._order = itertools.count()
        self._releases = RecentEvents(RATE_WINDOW_S)
        self._demand = {tier: TierDemand(RATE_WINDOW_S) for tier in TIERS}
        self._decreased_at = -math.inf  # when the window last shrank
        self._share = 1.0  # of the fleet's window: 1/N with N routers sharing the fleet
        LIMIT.set(self.limit)

    def set_share(self, share: float) -> None:
        """This router's share of the fleet's window (1/N of N routers): the window and
        its bounds scale with it, so that N routers together keep to the fleet's."""
        scaled, self._share = self.limit * share / self._share, share
        self.limit = min(max(scaled, 1.0), self._bound("max_limit"))
        LIMIT.set(self.limit)
        self._dispatch()

    def fleet_changed(self) -> None:
        """A load report came: waiters held back by the engines' queues may go now, and
        without engine priority a window above the fleet's running slots comes down to
        them (the lower tiers' share of it would queue in engines that serve in arrival
        order, ahead of the next critical arrivals)."""
        ceiling = self._ceiling()
        if self.limit > ceiling:
            self.limit = ceiling
            LIMIT.set(self.limit)
        self._dispatch()

    def _fleet_slots(self) -> float:
        """This router's part of the fleet's running slots; 0 if no engine reports them."""
        return self._running_slots() * self._share

    def _ceiling(self) -> float:
        """The window's upper bound: ``max_limit``, and without engine priority the fleet's
        running slots, where reported."""
        ceiling = self._bound("max_limit")
        slots = 0.0 if self.settings.engine_priority else self._fleet_slots()
        return min(ceiling, max(slots, self._bound("min_limit"))) if slots else ceiling

    def _bound(self, name: str) -> float:
        return max(1.0, float(getattr(self.settings, name)) * self._share)

    async def acquire(self, tenant: str, tier: str, cost: int, deadline: float | None) -> Slot:
        """Waits for a slot; ResourceExhausted when shed, DeadlineExceeded at the deadline.
        Cancellation (the client went away) gives the place up."""
        now = self._clock()
        self._demand[tier].arrived(now)
        bound = now + self.settings.max_queue_wait_s.get(tier, 5.0)
        ticket = Ticket(
            tenant,
            tier,
            cost,
            min(deadline or bound, bound),
            next(self._order),
            now,
            asyncio.get_running_loop().create_future(),
        )
        if not any(self._waiting.values()) and self._room(tier):
            self._grant(ticket)  # nothing waits and its tier has room: the common case
            return Slot(self, ticket)
        self._enqueue(ticket)
        self._dispatch()  # granted now if its tier has room and nothing before it waits
        if ticket.granted.done():
            return Slot(self, ticket)
        try:
            self._shed_if_hopeless(ticket, now)
        except ResourceExhausted:
            self._remove(ticket)
            raise
        try:
            await asyncio.wait_for(asyncio.shield(ticket.granted), ticket.deadline - now)
        except TimeoutError:
            if not ticket.granted.done():
                self._remove(ticket)
                ADMISSION_OUTCOMES.labels(tenant, tier, "deadline").inc()
                raise DeadlineExceeded(f"no slot within {ticket.deadline - now:.1f} s") from None
        except asyncio.CancelledError:
            if ticket.granted.done():  # granted just as the client left: give it back
                self.release(ticket, None)
            else:
                self._remove(ticket)
            raise
        return Slot(self, ticket)

    def release(self, ticket: Ticket, first_token_at: float | None) -> None:
        self.in_flight -= 1
        self._in_flight_by_tier[ticket.tier] -= 1
        ADMITTED.labels(ticket.tier).dec()
        now = self._clock()
        self._demand[ticket.tier].held(now - ticket.granted_at)
        self._releases.add(now)
        if first_token_at is not None:
            # The window's signal is the fleet's own latency, from the slot to the first
            # token: time spent in this queue is what the window causes, not what it sees.
            strictest = self._strictest_tier(ticket)
            target = self.settings.ttft_target_s.get(strictest, 1.0)
            self._adapt(first_token_at - ticket.granted_at <= target, strictest, ticket)
        self._dispatch()

    # -- the window ------------------------------------------------------------------

    def _strictest_tier(self, ticket: Ticket) -> str:
        """The tier with the tightest first-token target among those being served or
        waiting: the window is sized for the most demanding traffic present."""
        present = {ticket.tier} | {
            tier for tier in TIERS if self._in_flight_by_tier[tier] > 0 or self._waiting[tier]
        }
        return min(present, key=lambda tier: self.settings.ttft_target_s.get(tier, 1.0))

    def _adapt(self, met: bool, strictest: str, ticket: Ticket) -> None:
        s = self.settings
        held = self._in_flight_by_tier[strictest]
        displaceable = self.in_flight - held  # slots other tiers hold
        if not met:
            # A request let in before the last decrease saw the larger window's load: its
            # miss is no news (one decrease per round of requests, as in TCP). Shrinking
            # only helps by keeping other tiers' load off the engines: below what the
            # strictest tier itself holds, it would only queue that tier behind its own
            # generations.
            if displaceable > 0 and ticket.granted_at >= self._decreased_at:
                self.limit = max(self._bound("min_limit"), held, self.limit * s.decrease)
                self._decreased_at = self._clock()
        elif not self._saturated_for(strictest) and self._window_binds():
            self.limit = min(self._ceiling(), self.limit + 1 / self.limit)  # +1/window
        LIMIT.set(self.limit)

    def _window_binds(self) -> bool:
        """Whether the window is what holds work back (the caller has seen some engine
        without a queue): it is full, or requests wait here. With engine priority always
        then (the slots kept for the higher tiers' coming traffic are inside the window,
        and an engine that can take a slot back by preemption should run full). Without
        it, a tier held to its share waits by design, that share being the higher tiers'
        headroom, but only a share of what the engines run at once: the window grows up
        to the fleet's running slots (this router's part of them), so that a fleet larger
        than the initial window is not held to a fraction of it."""
        if self.in_flight + 1 >= self.limit:
            return True
        if not any(self._waiting.values()):
            return False
        return self.settings.engine_priority or self.limit < self._fleet_slots()

    def _grant(self, ticket: Ticket) -> None:
        self.in_flight += 1
        self._in_flight_by_tier[ticket.tier] += 1
        ADMITTED.labels(ticket.tier).inc()
        ticket.granted_at = self._clock()
        # A tenant that was idle starts level with the busiest waiting ones: it may not
        # bank credit for the time it sent nothing.
        floor = self._floor()
        served = self._served.get(ticket.tenant, floor)
        self._served[ticket.tenant] = max(served, floor) + ticket.cost
        QUEUE_WAIT.labels(ticket.tier).observe(ticket.granted_at - ticket.arrived)
        ADMISSION_OUTCOMES.labels(ticket.tenant, ticket.tier, "admitted").inc()
        if not ticket.granted.done():
            ticket.granted.set_result(None)

    def _room(self, tier: str) -> bool:
        if self.settings.engine_priority:
            # Slots that lower tiers hold are the engine's to take back (it preempts their
            # generations): a tier counts only its own and the higher tiers'.
            held = sum(self._in_flight_by_tier[t] for t in TIERS[: TIERS.index(tier) + 1])
            # Yet not the slots the higher tiers' recent traffic is about to take: each
            # would come back as a preemption, and a generation preempted again and again
            # loses its first-token target as surely as one kept waiting here.
            # A lower tier's request that would only queue in the engines waits here
            # instead, where the newest go first and the hopeless are refused: while a
            # higher tier is about, whose next arrivals it would otherwise queue behind
            # preempted work. Alone, its own queue is as well in the engines as here.
            room = held + self._reserved_above(tier) < self.limit
            return room and not (self._higher_present(tier) and self._saturated_for(tier))
        share = self.settings.window_share.get(tier, 1.0)
        return self.in_flight + self._reserved_above(tier) < self.limit * share

    def _saturated_for(self, tier: str) -> bool:
        """Whether every engine queues work that a request of ``tier`` would wait behind:
        with engine priority, work of its tier or more urgent (it runs ahead of the rest,
        or preempts it: a queue of preempted lower-tier work is no sign that the engines
        cannot take it); without, any."""
        priority = TIER_PRIORITY.get(tier) if self.settings.engine_priority else None
        return self._saturated(priority)

    def _higher_present(self, tier: str) -> bool:
        """Whether a tier above ``tier`` holds slots, waits or has arrived of late."""
        now = self._clock()
        return any(
            self._in_flight_by_tier[higher]
            or self._waiting[higher]
            or self._demand[higher].recent(now)
            for higher in TIERS[: TIERS.index(tier)]
        )

    def _reserved_above(self, tier: str) -> float:
        """Slots the higher tiers' recent traffic is expected to need beyond those it
        holds: a lower tier's slot is held for a whole generation, so it leaves these
        free rather than make the next higher-tier arrivals wait for one to end."""
        now = self._clock()
        return sum(
            max(0.0, self._demand[higher].slots(now) - self._in_flight_by_tier[higher])
            for higher in TIERS[: TIERS.index(tier)]
        )

    def _dispatch(self) -> None:
        while True:
            ticket = self._next()
            if ticket is None:
                return
            self._remove(ticket)
            self._grant(ticket)

    def _next(self) -> Ticket | None:
        """Highest tier with room first; in it, the tenant served least; its earliest
        deadline."""
        for tier in TIERS:
            tenants = self._waiting[tier]
            if tenants and self._room(tier):
                floor = self._floor()
                tenant = min(tenants, key=lambda t: (self._served.get(t, floor), t))
                return self._pick(tenants[tenant])
        return None

    def _pick(self, waiting: list[Ticket]) -> Ticket:
        """Of one tenant's waiting tickets (in arrival order): the earliest deadline while
        the queue moves, the newest once it stands."""
        if self._standing(waiting[0]):
            return waiting[-1]
        return min(waiting, key=lambda t: (t.deadline, t.order))

    def _standing(self, oldest: Ticket) -> bool:
        share = self.settings.newest_first_after.get(oldest.tier, 0.0)
        target = self.settings.ttft_target_s.get(oldest.tier, 1.0)
        return share > 0 and self._clock() - oldest.arrived > target * share

    def _floor(self) -> float:
        """The lowest counter among tenants with requests waiting."""
        waiting = [self._served.get(t, 0.0) for tier in self._waiting.values() for t in tier]
        return min(waiting, default=0.0)

    # -- the queue -------------------------------------------------------------------

    def _enqueue(self, ticket: Ticket) -> None:
        self._waiting[ticket.tier].setdefault(ticket.tenant, []).append(ticket)
        QUEUED.labels(ticket.tier).inc()

    def _remove(self, ticket: Ticket) -> None:
        queue = self._waiting[ticket.tier].get(ticket.tenant, [])
        if ticket in queue:
            queue.remove(ticket)
            QUEUED.labels(ticket.tier).dec()
            if not queue:
                del self._waiting[ticket.tier][ticket.tenant]

    def _shed_if_hopeless(self, ticket: Ticket, now: float) -> None:
        """Refuses at once what the queue could not serve in time (by tier)."""
        wait = self.expected_wait_s(ticket.tier)
        if now + wait > ticket.deadline:  # its tier's bound on waiting, or the client's
            reason = f"a slot is about {wait:.1f} s away, past the request's deadline"
        elif ticket.tier == "sheddable" and self._saturated_for(ticket.tier):
            reason = "the fleet is saturated; sheddable requests are refused"
        else:
            return
        ADMISSION_OUTCOMES.labels(ticket.tenant, ticket.tier, "shed").inc()
        raise ResourceExhausted(reason, retry_after_s=max(wait, 0.1))

    def expected_wait_s(self, tier: str) -> float:
        """How long a new request of ``tier`` would wait: the requests ahead of it over the
        recent rate of releases."""
        ahead = 0
        for t in TIERS:
            if t == tier:
                # A standing queue lets the newest in first: only its tenants' turns
                # are ahead.
                ahead += sum(
                    1 if self._standing(q[0]) else len(q) for q in self._waiting[t].values()
                )
                break
            ahead += sum(len(q) for q in self._waiting[t].values())
        rate = self._releases.rate(self._clock())
        return (ahead + 1) / rate if rate else 0.0  # no releases seen yet: no estimate

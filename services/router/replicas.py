"""The inference replicas behind the router: discovery, a link to each, their load and
health.

Every discovered endpoint gets a link (connector.py), a circuit breaker and the load it
last pushed (``Inference.WatchLoad``); the router's own view adds the streams it has open
there, the ones it ended since the last report, and the prefill it sent that awaits its
first token. Scheduling reads all of it as candidates (scheduling/types.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import AsyncIterator, Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from prometheus_client import Counter, Gauge

from llmmesh.runtime.errors import MeshError, Unavailable
from services.router.breaker import BreakerState, CircuitBreaker
from services.router.config import PoolSettings
from services.router.connector import Connector, LoadReport, ReplicaLink
from services.router.endpoints import Discovery, Endpoint
from services.router.routing import Saturation
from services.router.scheduling import Candidate
from services.router.scheduling.types import waiting_as_urgent

log = logging.getLogger(__name__)

IN_FLIGHT = Gauge("llm_router_endpoint_in_flight", "Streams in flight, by replica", ["endpoint"])
# Fault domains: a replica's models fail apart (one model's dead instance leaves the
# others to serve), so breakers and failures are per (replica, model).
BREAKER_OPEN = Gauge(
    "llm_router_breaker_open", "1 while a replica's breaker for a model is open",
    ["endpoint", "model"],
)  # fmt: skip
FAILURES = Counter(
    "llm_router_replica_failures_total",
    "Requests a replica failed (not the request's own fault), by model and tenant tier",
    ["endpoint", "model", "tier"],
)

SILENT_ENDED = Counter(
    "llm_router_silent_replica_streams_total",
    "Streams moved off a replica that fell silent (no load report for silent_after_s)",
)


class PeerInFlight(Protocol):
    def in_flight(self, address: str) -> int: ...


RECONNECT_BACKOFF_S = (0.05, 0.5)
CLOSE_GRACE_S = 30.0  # streams on a replica that left discovery may finish
# The engine's running limit in a load report's metrics (llm_engine_max_running_sequences).
RUNNING_LIMIT = "max_running_sequences"


@dataclass
class Replica:
    endpoint: Endpoint
    link: ReplicaLink
    new_breaker: Callable[[], CircuitBreaker]
    breakers: dict[str, CircuitBreaker] = field(default_factory=dict)  # model -> its breaker
    last_report_at: float | None = None  # monotonic; None until the first report
    down: bool = False  # its report stream broke after reporting: gone until it reports
    reports: Mapping[str, Mapping[str, float]] = field(default_factory=dict)  # model -> load
    failed_models: frozenset[str] = frozenset()  # models it reports stopped answering
    # Models whose breaker opened while the replica's reports said so too (engine not
    # reachable, the model failed): an outage the reports follow, closed by them.
    reported_outages: set[str] = field(default_factory=set)
    engine_reachable: bool = True
    in_flight: int = 0
    # Per model: streams this router ended since the last report, which may still count them.
    ended: dict[str, int] = field(default_factory=dict)
    prefilling: int = 0  # prompt tokens sent that await their first token
    follower: asyncio.Task[None] | None = None

    @property
    def address(self) -> str:
        return self.endpoint.address

    def breaker(self, model: str) -> CircuitBreaker:
        found = self.breakers.get(model)
        if found is None:
            found = self.breakers[model] = self.new_breaker()
        return found


class ReplicaSet:
    def __init__(
        self,
        discovery: Discovery,
        connector: Connector,
        settings: PoolSettings,
        local_region: str,
        clock: Callable[[], float] = time.monotonic,
        *,
        peers: PeerInFlight | None = None,
    ) -> None:
        """``peers``: the streams the fleet's other routers have open on each replica,
        counted with this router's own (several routers over one fleet)."""
        self._peers = peers
        self._discovery = discovery
        self._connector = connector
        self._settings = settings
        self._region = local_region
        self._clock = clock
        self._replicas: dict[str, Replica] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._watched: dict[str, set[asyncio.Timeout]] = {}  # replica -> streams on it
        self._report_listeners: list[Callable[[], None]] = []

    async def start(self) -> None:
        self._tasks.append(asyncio.create_task(self._follow_discovery()))
        self._tasks.append(asyncio.create_task(self._end_silent_streams()))

    @contextlib.asynccontextmanager
    async def watched(self, replica: Replica) -> AsyncIterator[None]:
        """Around a wait on ``replica`` (its first chunk, its stream): Unavailable if the
        replica falls silent meanwhile (``silent_after_s`` without a load report), since
        a partition leaves its connections open and quiet rather than failing them."""
        streams = self._watched.setdefault(replica.address, set())
        try:
            async with asyncio.timeout(None) as deadline:
                streams.add(deadline)
                yield
        except TimeoutError:
            if not deadline.expired():
                raise
            raise Unavailable("inference replica fell silent (no load report)") from None
        finally:
            streams.discard(deadline)

    async def _end_silent_streams(self) -> None:
        while True:
            await asyncio.sleep(self._settings.report_interval_s)  # the watchdog's period
            now, limit = self._clock(), self._settings.silent_after_s
            loop = asyncio.get_running_loop()
            for address, streams in self._watched.items():
                replica = self._replicas.get(address)
                if replica is None or not streams:
                    continue
                last = replica.last_report_at
                if replica.down or (last is not None and now - last > limit):
                    for deadline in list(streams):
                        if deadline.when() is None:  # not already being ended
                            SILENT_ENDED.inc()
                            deadline.reschedule(loop.time())

    async def close(self) -> None:
        tasks = self._tasks + [r.follower for r in self._replicas.values() if r.follower]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for replica in self._replicas.values():
            await replica.link.close()

    def __getitem__(self, address: str) -> Replica:
        return self._replicas[address]

    def candidates(self, model: str, priority: int | None = None) -> list[Candidate]:
        """The replicas as a request for ``model`` sees them; ``priority``: its engine
        scheduling priority (a queue of less urgent work does not delay it)."""
        now, s = self._clock(), self._settings
        out = []
        for r in self._replicas.values():
            alive = reports_alive(r.last_report_at, r.down, now, s.stale_after_s)
            elsewhere = self._peers.in_flight(r.address) if self._peers is not None else 0
            out.append(
                Candidate(
                    endpoint=r.endpoint,
                    region=r.endpoint.region or self._region,
                    in_flight=r.in_flight + elsewhere,
                    ended=r.ended.get(model, 0),
                    prefilling=r.prefilling,
                    load=r.reports.get(model) if self._fresh(r, now) else None,
                    priority=priority,
                    healthy=alive
                    and r.engine_reachable
                    and model not in r.failed_models
                    and r.breaker(model).available(now),
                )
            )
        return out

    def in_flight_counts(self) -> dict[str, int]:
        """Streams this router has open, per replica that has any."""
        return {a: r.in_flight for a, r in self._replicas.items() if r.in_flight}

    def can_serve(self, model: str) -> bool:
        """Some healthy replica serves ``model`` now."""
        return any(c.healthy and c.endpoint.serves(model) for c in self.candidates(model))

    def saturated(
        self, limits: Saturation, subsets: Collection[str] = (), priority: int | None = None
    ) -> bool:
        """Every replica of the fleet (``_fleet``) has an engine with a queue or a nearly
        full cache. ``priority``: only a queue of work at least that urgent counts (a
        request of that priority would run ahead of the rest, or preempt it)."""
        reporting = self._fleet(self._clock(), subsets)
        return bool(reporting) and all(
            any(
                waiting_as_urgent(load, priority) >= limits.waiting
                or load.get("kv_utilization", 0) >= limits.kv_utilization
                for load in r.reports.values()
            )
            for r in reporting
        )

    def running_slots(self, subsets: Collection[str] = ()) -> float:
        """Sequences the fleet's engines (``_fleet``) run at once, as their reports say:
        per replica, the largest running limit among its models (each model's engine has
        its own, and traffic for one model can fill only that one); 0 when no engine
        reports one."""
        return sum(
            max((load.get(RUNNING_LIMIT, 0.0) for load in r.reports.values()), default=0.0)
            for r in self._fleet(self._clock(), subsets)
            if r.engine_reachable
        )

    def _fleet(self, now: float, subsets: Collection[str]) -> list[Replica]:
        """The reporting replicas that ordinary traffic goes to: those of ``subsets`` (the
        split's weighted ones; empty: any) in this router's region, else in any region,
        else every one that reports. A replica of a subset at weight 0 (a canary before
        its share) or of another region (failover) serves only what is pinned or failed
        over to it: its engine's idle slots are not this fleet's, and counted, they hid
        the fleet's queues from admission (no engine queued in every replica)."""
        reporting = [r for r in self._replicas.values() if self._fresh(r, now)]
        weighted = [r for r in reporting if not subsets or r.endpoint.version in subsets]
        local = [r for r in weighted if (r.endpoint.region or self._region) == self._region]
        return local or weighted or reporting

    def _fresh(self, replica: Replica, now: float) -> bool:
        last = replica.last_report_at
        return last is not None and now - last <= self._settings.stale_after_s

    # -- a stream's life on a replica --------------------------------------------------

    def acquire(self, replica: Replica, model: str, prefill_tokens: int) -> None:
        replica.breaker(model).on_pick(self._clock())
        replica.in_flight += 1
        replica.prefilling += prefill_tokens
        IN_FLIGHT.labels(replica.address).set(replica.in_flight)

    def first_chunk(self, replica: Replica, model: str, prefill_tokens: int, ok: bool) -> None:
        """The stream started (``ok``) or did not: its prefill is no longer pending."""
        replica.prefilling -= prefill_tokens
        if ok:
            replica.breaker(model).on_success()
            BREAKER_OPEN.labels(replica.address, model).set(0)

    def release(self, replica: Replica, model: str) -> None:
        replica.in_flight -= 1
        replica.ended[model] = replica.ended.get(model, 0) + 1
        IN_FLIGHT.labels(replica.address).set(replica.in_flight)

    def failed(self, replica: Replica, model: str, tier: str, err: MeshError) -> None:
        """The replica failed a request for ``model`` (not the request's own fault)."""
        now, breaker = self._clock(), replica.breaker(model)
        breaker.on_failure(now)
        if not replica.engine_reachable or model in replica.failed_models:
            replica.reported_outages.add(model)
        BREAKER_OPEN.labels(replica.address, model).set(0 if breaker.available(now) else 1)
        FAILURES.labels(replica.address, model, tier).inc()
        log.warning(
            "replica failed a request",
            extra={"fields": {"endpoint": replica.address, "model": model, "error": err.message}},
        )

    @staticmethod
    def abandoned(replica: Replica, model: str) -> None:
        """The request ended with no verdict on the replica (the client went away, or the
        request itself was refused)."""
        replica.breaker(model).on_abandon()

    # -- discovery and load ------------------------------------------------------------

    async def _follow_discovery(self) -> None:
        async for endpoints in self._discovery.watch():
            self.apply(endpoints)

    def apply(self, endpoints: list[Endpoint]) -> None:
        wanted = {e.address: e for e in endpoints}
        for address in set(self._replicas) - set(wanted):
            gone = self._replicas.pop(address)
            if gone.follower:
                gone.follower.cancel()
            self._tasks.append(asyncio.create_task(gone.link.close(CLOSE_GRACE_S)))
        for address, endpoint in wanted.items():
            replica = self._replicas.get(address)
            if replica is None:
                self._replicas[address] = self._new_replica(endpoint)
            else:
                replica.endpoint = endpoint  # metadata (version, region) may change
        log.info("endpoints", extra={"fields": {"endpoints": sorted(wanted)}})

    def _new_replica(self, endpoint: Endpoint) -> Replica:
        s = self._settings
        replica = Replica(
            endpoint,
            self._connector.connect(endpoint),
            lambda: CircuitBreaker(s.breaker_failures, s.breaker_open_s),
        )
        replica.follower = asyncio.create_task(self._follow_load(replica))
        return replica

    async def _follow_load(self, replica: Replica) -> None:
        """Keeps the replica's latest per-model load, redialing when the stream breaks or
        brings nothing for ``silent_after_s`` (a stream stuck open would otherwise leave
        the replica's last report standing, and the replica out, for good)."""
        while True:
            try:
                await self._read_reports(replica)
            except (MeshError, TimeoutError):
                pass
            except Exception:  # whatever it was, the reports must go on
                where = {"endpoint": replica.address}
                log.exception("load reports failed", extra={"fields": where})
            if replica.last_report_at is not None:  # it was there and went away
                replica.down, replica.last_report_at = True, None
            await asyncio.sleep(random.uniform(*RECONNECT_BACKOFF_S))  # reconnect pacing

    async def _read_reports(self, replica: Replica) -> None:
        reports = replica.link.watch_load(self._settings.report_interval_s)
        async with contextlib.aclosing(reports):
            while True:
                async with asyncio.timeout(self._settings.silent_after_s):
                    report = await anext(reports, None)
                if report is None:
                    return
                self._reported(replica, report)

    def _reported(self, replica: Replica, report: LoadReport) -> None:
        replica.reports = report.models
        replica.failed_models = report.failed_models
        replica.ended = {}
        replica.engine_reachable = report.engine_reachable
        replica.last_report_at = now = self._clock()
        replica.down = False
        self._note_outages(replica, report, now)
        if report.engine_reachable:
            self._close_recovered(replica, report, now)
        for listener in self._report_listeners:
            listener()

    def on_report(self, listener: Callable[[], None]) -> None:
        """``listener`` is called after each load report is taken in."""
        self._report_listeners.append(listener)

    @staticmethod
    def _note_outages(replica: Replica, report: LoadReport, now: float) -> None:
        """Breakers already open when a report shows the outage behind them (the report
        may come a moment after the failures that opened them) are the reports' to close."""
        for model, breaker in replica.breakers.items():
            down = not report.engine_reachable or model in report.failed_models
            if down and breaker.state(now) is not BreakerState.CLOSED:
                replica.reported_outages.add(model)

    @staticmethod
    def _close_recovered(replica: Replica, report: LoadReport, now: float) -> None:
        """A breaker opened by an outage the replica's reports showed (engine down, the
        model failed) closes, past its cool-down, once the reports show the model well
        again, instead of waiting for one probe request: requests that all failed over at
        once would otherwise find the probe slot taken and fail. A replica that fails
        requests while reporting well keeps its breaker until a probe succeeds."""
        for model in list(replica.reported_outages):
            breaker = replica.breaker(model)
            healthy = model in report.models and model not in report.failed_models
            if healthy and breaker.state(now) is BreakerState.HALF_OPEN:
                breaker.on_success()
                replica.reported_outages.discard(model)
                BREAKER_OPEN.labels(replica.address, model).set(0)


def reports_alive(last_report_at: float | None, down: bool, now: float, stale_s: float) -> bool:
    """Whether a replica's load reports say it is there: a recent report, or none yet and
    its stream not known broken (just discovered, or still connecting: the breaker catches
    a replica that is not there)."""
    if last_report_at is None:
        return not down
    return now - last_report_at <= stale_s

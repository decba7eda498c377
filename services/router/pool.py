"""The inference replicas behind the router: discovery, load, health, picking, retries.

Every discovered replica has a client, a circuit breaker and the load it last pushed
(``Inference.WatchLoad``). A request is picked onto a replica (picking.py); if it fails
before its first chunk it is retried elsewhere (tenacity: bounded attempts, jittered
backoff, within the deadline). If a stream breaks after text was sent, it resumes on
another replica from the prompt plus the text already sent, so the client's text
continues without a gap or a repeat.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

import grpc
from prometheus_client import Counter, Gauge, Histogram
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception_type,
    stop_after_attempt,
    wait_random_exponential,
)
from tenacity.stop import stop_base

from llmmesh.runtime import tracing
from llmmesh.runtime.errors import ResourceExhausted, Unavailable
from llmmesh.runtime.metadata import DESTINATION_ENDPOINT
from llmmesh.types import Chunk, FinishReason, InferenceCall, Route
from llmmesh.v1 import inference_pb2, inference_pb2_grpc
from services.router.affinity import prefix_hashes
from services.router.breaker import CircuitBreaker
from services.router.endpoints import Discovery, Endpoint
from services.router.routing import PolicyHolder
from services.router.scheduling import (
    Candidate,
    Decision,
    PickRequest,
    Scheduler,
    SchedulingState,
)
from services.router.scheduling.filters import split_point
from services.router.upstreams import CHANNEL_OPTIONS, ReplicaClient, RouteHints

log = logging.getLogger(__name__)

PICKS = Counter(
    "llm_router_picks_total", "Requests sent, by replica and its subset", ["endpoint", "subset"]
)
IN_FLIGHT = Gauge("llm_router_endpoint_in_flight", "Streams in flight, by replica", ["endpoint"])
DECISIONS = Counter("llm_router_decisions_total", "Picking decisions, by reason", ["reason"])
PICK_SECONDS = Histogram(
    "llm_router_pick_seconds",
    "Time to pick a replica",
    buckets=(2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2),
)
RETRIES = Counter("llm_router_retries_total", "Attempts retried before the first chunk")
RESUMED = Counter("llm_router_resumed_streams_total", "Streams moved to another replica")
BREAKER_OPEN = Gauge("llm_router_breaker_open", "1 while a replica's breaker is open", ["endpoint"])

RECONNECT_BACKOFF_S = (0.05, 0.5)
CLOSE_GRACE_S = 30.0  # streams on a replica that left discovery may finish


@dataclass(frozen=True)
class PoolSettings:
    local_region: str = "local"
    report_interval_s: float = 0.25
    stale_after_s: float = 1.0
    breaker_failures: int = 3
    breaker_open_s: float = 2.0
    attempts: int = 3  # per stream start, first try included
    max_resumes: int = 2  # times one stream may move after text was sent
    # host:port of the local sidecar listener that forwards each call to the endpoint it
    # names in DESTINATION_ENDPOINT; empty: replicas are dialed directly.
    via: str = ""


@dataclass
class Replica:
    endpoint: Endpoint
    channel: grpc.aio.Channel
    client: ReplicaClient
    breaker: CircuitBreaker
    last_report_at: float | None = None  # monotonic; None until the first report
    down: bool = False  # its report stream broke after reporting: gone until it reports
    reports: dict[str, dict[str, float]] = field(default_factory=dict)  # model -> metrics
    engine_reachable: bool = True
    in_flight: int = 0
    # Per model: streams this router ended since the last report, which may still count them.
    ended: dict[str, int] = field(default_factory=dict)
    metadata: tuple[tuple[str, str], ...] = ()  # on every call: where a sidecar routes it
    prefilling: int = 0  # prompt tokens sent that await their first token
    follower: asyncio.Task[None] | None = None


class InferencePool:
    def __init__(
        self,
        discovery: Discovery,
        routing: PolicyHolder,
        settings: PoolSettings,
        scheduler: Scheduler | None = None,
    ) -> None:
        self._discovery = discovery
        self._routing = routing
        self._settings = settings
        self._scheduler = scheduler or Scheduler(SchedulingState(settings.local_region))
        self._replicas: dict[str, Replica] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._rng = random.Random()

    async def start(self) -> None:
        self._tasks.append(asyncio.create_task(self._follow_discovery()))

    async def close(self) -> None:
        tasks = self._tasks + [r.follower for r in self._replicas.values() if r.follower]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for replica in self._replicas.values():
            await replica.channel.close()

    # -- picking ---------------------------------------------------------------------

    def candidates(self, model: str) -> list[Candidate]:
        now, s = time.monotonic(), self._settings
        out = []
        for r in self._replicas.values():
            fresh = self._fresh(r, now)
            alive = reports_alive(r.last_report_at, r.down, now, s.stale_after_s)
            healthy = alive and r.engine_reachable and r.breaker.available(now)
            out.append(
                Candidate(
                    endpoint=r.endpoint,
                    region=r.endpoint.region or s.local_region,
                    in_flight=r.in_flight,
                    ended=r.ended.get(model, 0),
                    prefilling=r.prefilling,
                    load=r.reports.get(model) if fresh else None,
                    healthy=healthy,
                )
            )
        return out

    def saturated(self) -> bool:
        """Every replica that reports has an engine with a queue or a nearly full cache."""
        limits, now = self._routing.current.saturation, time.monotonic()
        reporting = [r for r in self._replicas.values() if self._fresh(r, now)]
        return bool(reporting) and all(
            any(
                load.get("waiting", 0) >= limits.waiting
                or load.get("kv_utilization", 0) >= limits.kv_utilization
                for load in r.reports.values()
            )
            for r in reporting
        )

    def _fresh(self, replica: Replica, now: float) -> bool:
        last = replica.last_report_at
        return last is not None and now - last <= self._settings.stale_after_s

    def pick(self, request: PickRequest) -> Decision:
        started = time.perf_counter()
        with tracing.tracer.start_as_current_span("endpoint.pick") as span:
            decision = self._scheduler.pick(
                request, self.candidates(request.model), self._routing.current
            )
            if decision.candidate is not None:
                span.set_attribute("llm.endpoint", decision.candidate.endpoint.address)
                span.set_attribute("llm.subset", decision.subset)
        PICK_SECONDS.observe(time.perf_counter() - started)
        for reason in decision.reasons:
            DECISIONS.labels(reason).inc()
        return decision

    # -- generation ------------------------------------------------------------------

    async def generate(self, call: InferenceCall, hints: RouteHints) -> AsyncGenerator[Chunk, None]:
        request = PickRequest(
            model=call.model,
            prefix=prefix_hashes(call.prompt),
            prompt_chars=len(call.prompt),
            session_key=hints.session_key,
            color=hints.color,
            split_point=split_point(hints.session_key, self._rng),
        )
        sent, tokens, resumed = [], 0, 0
        attempt_call = call
        while True:
            replica, stream, chunk = await self._start(attempt_call, request, hints.deadline)
            try:
                while chunk.finish_reason is None:
                    yield chunk
                    sent.append(chunk.text)
                    tokens += chunk.num_tokens
                    chunk = await _next_chunk(stream)
                route = Route(
                    replica.endpoint.address,
                    replica.endpoint.version,
                    replica.endpoint.region or self._settings.local_region,
                )
                yield replace(chunk, route=route, resumed=resumed)
                return
            except Unavailable as err:
                self._failed(replica, err)
                if resumed >= self._settings.max_resumes or _past(hints.deadline):
                    raise
                resumed += 1
                RESUMED.inc()
                request = replace(request, avoid=request.avoid | {replica.endpoint.address})
                attempt_call = _continuation(call, "".join(sent), tokens)
                if attempt_call.sampling.max_tokens <= 0:  # broke just before its last chunk
                    yield Chunk("", 0, FinishReason.LENGTH, resumed=resumed)
                    return
                log.warning(
                    "stream resumes on another replica",
                    extra={"fields": {"failed": replica.endpoint.address, "sent_tokens": tokens}},
                )
            finally:
                await stream.aclose()  # a generation cut short is cancelled at the replica now
                self._release(replica, call.model)

    async def _start(
        self, call: InferenceCall, request: PickRequest, deadline: float | None
    ) -> tuple[Replica, AsyncGenerator[Chunk, None], Chunk]:
        """Picks a replica and waits for its first chunk, retrying elsewhere on failure."""
        retrying = AsyncRetrying(
            stop=stop_after_attempt(self._settings.attempts) | _deadline_reached(deadline),
            wait=wait_random_exponential(multiplier=0.02, max=0.5),
            retry=retry_if_exception_type((Unavailable, ResourceExhausted)),
            before_sleep=lambda _: RETRIES.inc(),
            reraise=True,
        )
        failed = set(request.avoid)
        async for attempt in retrying:
            with attempt:
                return await self._attempt(call, replace(request, avoid=frozenset(failed)), failed)
        raise AssertionError("tenacity ended without an outcome")  # pragma: no cover

    async def _attempt(
        self, call: InferenceCall, request: PickRequest, failed: set[str]
    ) -> tuple[Replica, AsyncGenerator[Chunk, None], Chunk]:
        """One try: pick, send, wait for the first chunk. A failed replica joins ``failed``."""
        decision = self.pick(request)
        replica = self._replicas[decision.candidate.address]
        self._acquire(replica)
        replica.prefilling += decision.uncached_tokens
        stream = replica.client.generate(call)
        try:
            first = await _next_chunk(stream)
        except BaseException as err:
            await stream.aclose()
            self._release(replica, call.model)
            if isinstance(err, Unavailable | ResourceExhausted):
                self._failed(replica, err)
                failed.add(replica.endpoint.address)
            else:  # the client went away: no verdict on the replica
                replica.breaker.on_abandon()
            raise
        finally:
            replica.prefilling -= decision.uncached_tokens
        replica.breaker.on_success()
        BREAKER_OPEN.labels(replica.endpoint.address).set(0)
        return replica, stream, first

    def _acquire(self, replica: Replica) -> None:
        address = replica.endpoint.address
        replica.breaker.on_pick(time.monotonic())
        replica.in_flight += 1
        PICKS.labels(address, replica.endpoint.version).inc()
        IN_FLIGHT.labels(address).set(replica.in_flight)

    def _release(self, replica: Replica, model: str) -> None:
        replica.in_flight -= 1
        replica.ended[model] = replica.ended.get(model, 0) + 1
        IN_FLIGHT.labels(replica.endpoint.address).set(replica.in_flight)

    def _failed(self, replica: Replica, err: Exception) -> None:
        now = time.monotonic()
        replica.breaker.on_failure(now)
        is_open = not replica.breaker.available(now)
        BREAKER_OPEN.labels(replica.endpoint.address).set(1 if is_open else 0)
        log.warning(
            "replica failed a request",
            extra={"fields": {"endpoint": replica.endpoint.address, "error": str(err)}},
        )

    # -- discovery and load ------------------------------------------------------------

    async def _follow_discovery(self) -> None:
        async for endpoints in self._discovery.watch():
            self._apply(endpoints)

    def _apply(self, endpoints: list[Endpoint]) -> None:
        wanted = {e.address: e for e in endpoints}
        for address in set(self._replicas) - set(wanted):
            gone = self._replicas.pop(address)
            if gone.follower:
                gone.follower.cancel()
            self._tasks.append(asyncio.create_task(gone.channel.close(CLOSE_GRACE_S)))
        for address, endpoint in wanted.items():
            replica = self._replicas.get(address)
            if replica is None:
                self._replicas[address] = self._new_replica(endpoint)
            else:
                replica.endpoint = endpoint  # metadata (version, region) may change
        log.info("endpoints", extra={"fields": {"endpoints": sorted(wanted)}})

    def _new_replica(self, endpoint: Endpoint) -> Replica:
        s = self._settings
        channel = grpc.aio.insecure_channel(s.via or endpoint.address, options=CHANNEL_OPTIONS)
        destination = ((DESTINATION_ENDPOINT, endpoint.address),) if s.via else ()
        replica = Replica(
            endpoint=endpoint,
            channel=channel,
            client=ReplicaClient(channel, endpoint.address, destination),
            breaker=CircuitBreaker(s.breaker_failures, s.breaker_open_s),
            metadata=destination,
        )
        replica.follower = asyncio.create_task(self._follow_load(replica))
        return replica

    async def _follow_load(self, replica: Replica) -> None:
        """Keeps the replica's latest per-model load, reconnecting when the stream breaks."""
        stub: Any = inference_pb2_grpc.InferenceStub(replica.channel)
        request = inference_pb2.WatchLoadRequest(
            max_interval_ms=int(self._settings.report_interval_s * 1000)
        )
        while True:
            with contextlib.suppress(grpc.aio.AioRpcError):
                async for report in stub.WatchLoad(request, metadata=replica.metadata):
                    replica.reports = {m.model: load_metrics(m) for m in report.models}
                    replica.ended = {}
                    replica.engine_reachable = report.engine_reachable
                    replica.last_report_at = time.monotonic()
                    replica.down = False
            if replica.last_report_at is not None:  # it was there and went away
                replica.down, replica.last_report_at = True, None
            await asyncio.sleep(random.uniform(*RECONNECT_BACKOFF_S))  # reconnect pacing


def load_metrics(model: inference_pb2.ModelLoad) -> dict[str, float]:
    """A model's load as scheduling reads it: every metric the engine reports, and the
    report's named fields."""
    return {
        **model.metrics,
        "running": model.running,
        "waiting": model.waiting,
        "kv_utilization": model.kv_utilization,
        "prefix_cache_hit_rate": model.prefix_cache_hit_rate,
    }


def reports_alive(last_report_at: float | None, down: bool, now: float, stale_s: float) -> bool:
    """Whether a replica's load reports say it is there: a recent report, or none yet and
    its stream not known broken (just discovered, or still connecting: the breaker catches
    a replica that is not there)."""
    if last_report_at is None:
        return not down
    return now - last_report_at <= stale_s


async def _next_chunk(stream: AsyncIterator[Chunk]) -> Chunk:
    try:
        return await anext(stream)
    except StopAsyncIteration:
        raise Unavailable("inference replica ended the stream without a finish reason") from None


def _continuation(call: InferenceCall, sent_text: str, sent_tokens: int) -> InferenceCall:
    """The call that continues a broken stream: the text already sent becomes prompt."""
    sampling = replace(call.sampling, max_tokens=call.sampling.max_tokens - sent_tokens)
    return replace(call, prompt=call.prompt + sent_text, sampling=sampling)


def _past(deadline: float | None) -> bool:
    return deadline is not None and time.monotonic() >= deadline


class _deadline_reached(stop_base):  # noqa: N801 (named like tenacity's own stops)
    def __init__(self, deadline: float | None) -> None:
        self._deadline = deadline

    def __call__(self, retry_state: RetryCallState) -> bool:
        return _past(self._deadline)

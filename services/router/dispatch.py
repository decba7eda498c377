"""The dispatcher: a generation onto a replica, and kept going when replicas fail.

A request is scheduled onto a replica (scheduling/); if it fails before its first chunk
it is retried elsewhere (tenacity: bounded attempts, jittered backoff, within the
deadline). If a stream breaks after text was sent, it resumes on another replica from
the prompt plus the text already sent, so the client's text continues without a gap or a
repeat. A replica that refuses the request itself (INVALID_ARGUMENT, ...) has not
failed: the refusal goes to the client, with no retry and no mark on the replica.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import replace
from typing import NamedTuple

from prometheus_client import Counter, Histogram
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception_type,
    stop_after_attempt,
    wait_random_exponential,
)
from tenacity.stop import stop_base

from llmmesh import first_tokens
from llmmesh.runtime import tracing
from llmmesh.runtime.errors import NotFound, ResourceExhausted, Unavailable
from llmmesh.types import Chunk, FinishReason, InferenceCall, ModelCard, Route
from services.router.affinity import prefix_hashes
from services.router.canary_watch import CanaryWatch
from services.router.config import PoolSettings
from services.router.replicas import Replica, ReplicaSet
from services.router.routing import PolicyHolder
from services.router.scheduling import Decision, PickRequest, Scheduler
from services.router.scheduling.filters import split_point
from services.router.upstreams import RouteHints

log = logging.getLogger(__name__)

PICKS = Counter(
    "llm_router_picks_total", "Requests sent, by replica and its subset", ["endpoint", "subset"]
)
DECISIONS = Counter("llm_router_decisions_total", "Picking decisions, by reason", ["reason"])
PICK_SECONDS = Histogram(
    "llm_router_pick_seconds",
    "Time to pick a replica",
    buckets=(2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2),
)
RETRIES = Counter("llm_router_retries_total", "Attempts retried before the first chunk")
RESUMED = Counter("llm_router_resumed_streams_total", "Streams moved to another replica")

# What a replica failing looks like; anything else it raises is the request's own.
REPLICA_FAILURES = (Unavailable, ResourceExhausted)
# Jittered pauses between attempts: retries from many requests do not arrive together.
RETRY_WAIT = wait_random_exponential(multiplier=0.02, max=0.5)


class Dispatcher:
    """The router's InferenceClient."""

    def __init__(
        self,
        replicas: ReplicaSet,
        routing: PolicyHolder,
        settings: PoolSettings,
        scheduler: Scheduler,
        rng: random.Random | None = None,
        *,
        watch: CanaryWatch | None = None,
        session_home: Callable[[str], Awaitable[None]] | None = None,
    ) -> None:
        """``watch``: where each attempt's outcome goes, by subset (the canary's gates);
        ``session_home``: learns where another router placed a session, before a pick."""
        self._session_home = session_home
        self._replicas = replicas
        self._routing = routing
        self._settings = settings
        self._scheduler = scheduler
        self._rng = rng or random.Random()
        self._watch = watch

    def saturated(self, priority: int | None = None) -> bool:
        """Whether every engine that the split's traffic goes to has a queue (of work at
        ``priority`` or more urgent)."""
        routing = self._routing.current
        return self._replicas.saturated(routing.saturation, _weighted(routing.split), priority)

    def running_slots(self) -> float:
        """Sequences the engines that the split's traffic goes to run at once."""
        return self._replicas.running_slots(_weighted(self._routing.current.split))

    def pick(self, request: PickRequest, picks: list[_Pick]) -> Decision:
        """The scheduler's decision, noted in ``picks`` to be counted (``_count``) once
        the request's first chunk is on its way: metrics are off a first token's path."""
        started = time.perf_counter()
        with tracing.step("endpoint.pick") as span:
            decision = self._scheduler.pick(
                request,
                self._replicas.candidates(request.model, request.priority),
                self._routing.current,
            )
            if span is not None:
                span.set_attribute("llm.endpoint", decision.candidate.address)
                span.set_attribute("llm.subset", decision.subset)
        picks.append(_Pick(decision, time.perf_counter() - started))
        return decision

    async def describe(self, model: str) -> ModelCard:
        """The model's card from a replica: healthy ones that report the model first, the
        next one if a replica fails to answer; if none can, why the last one could not."""
        candidates = self._replicas.candidates(model)
        ordered = sorted(candidates, key=lambda c: (not c.healthy, c.load is None))
        why = "no replica is known"
        for candidate in ordered:
            try:
                return await self._replicas[candidate.address].link.describe(model)
            except (Unavailable, NotFound) as err:
                why = err.message
                log.warning(
                    "a replica did not describe its model",
                    extra={"fields": {"replica": candidate.address, "error": why}},
                )
        raise Unavailable(f"no replica of model '{model}' could describe it: {why}")

    async def generate(self, call: InferenceCall, hints: RouteHints) -> AsyncGenerator[Chunk, None]:
        if hints.session_key and self._session_home is not None:
            await self._session_home(hints.session_key)
        request = PickRequest(
            model=call.model,
            prefix=prefix_hashes(call.prompt, call.cache_salt),
            prompt_chars=len(call.prompt),
            session_key=hints.session_key,
            color=hints.color,
            split_point=split_point(hints.session_key, self._rng),
            priority=call.priority,
        )
        sent: list[str] = []
        picks: list[_Pick] = []
        tokens, resumed, attempt_call = 0, 0, call
        while True:
            try:
                started = await self._start(attempt_call, request, hints, picks)
            except BaseException:
                _count(picks)  # a failed start's picks now; a good one's after its chunk
                raise
            replica, fallback, stream, chunk = started
            if resumed:  # the prompt's cache reads were the first replica's, counted then
                chunk = replace(chunk, cached_tokens=0)
            try:
                async with self._replicas.watched(replica):
                    while chunk.finish_reason is None:
                        yield chunk
                        if picks:
                            _count(picks)
                        sent.append(chunk.text)
                        tokens += chunk.num_tokens
                        chunk = await _next_chunk(stream)
                yield replace(chunk, route=self._route(replica, fallback), resumed=resumed)
                return
            except Unavailable as err:
                self._replicas.failed(replica, call.model, hints.tier, err)
                if resumed >= self._settings.max_resumes or _past(hints.deadline):
                    raise
                resumed += 1
                RESUMED.inc()
                request = replace(request, avoid=request.avoid | {replica.address})
                attempt_call = _continuation(call, "".join(sent), tokens)
                if attempt_call.sampling.max_tokens <= 0:  # broke just before its last chunk
                    yield Chunk("", 0, FinishReason.LENGTH, resumed=resumed)
                    return
                log.warning(
                    "stream resumes on another replica",
                    extra={"fields": {"failed": replica.address, "sent_tokens": tokens}},
                )
            finally:
                _count(picks)  # if its only chunk was its last
                try:
                    await stream.aclose()  # a generation cut short is cancelled there now
                finally:
                    self._replicas.release(replica, call.model)

    def _route(self, replica: Replica, fallback: bool) -> Route:
        endpoint = replica.endpoint
        return Route(
            endpoint.address,
            endpoint.version,
            endpoint.region or self._scheduler.state.local_region,
            fallback,
        )

    async def _start(
        self, call: InferenceCall, request: PickRequest, hints: RouteHints, picks: list[_Pick]
    ) -> tuple[Replica, bool, AsyncGenerator[Chunk, None], Chunk]:
        """Picks a replica and waits for its first chunk, retrying elsewhere on failure;
        the replica, whether its subset is a fallback, its stream and first chunk."""
        failed = set(request.avoid)
        try:
            # Most first attempts succeed, and tenacity's loop costs a request more than
            # its pick when caches are cold (docs/benchmarks.md): it runs the retries.
            return await self._attempt(call, request, hints.tier, failed, picks)
        except REPLICA_FAILURES:
            if self._settings.attempts == 1 or _past(hints.deadline):
                raise
        retrying = AsyncRetrying(
            stop=stop_after_attempt(self._settings.attempts - 1)
            | _deadline_reached(hints.deadline),
            wait=RETRY_WAIT,
            retry=retry_if_exception_type(REPLICA_FAILURES),
            before=_pause_before_first_retry,
            before_sleep=lambda _: RETRIES.inc(),
            reraise=True,
        )
        async for attempt in retrying:
            with attempt:
                avoiding = replace(request, avoid=frozenset(failed))
                return await self._attempt(call, avoiding, hints.tier, failed, picks)
        raise AssertionError("tenacity ended without an outcome")  # pragma: no cover

    async def _attempt(
        self,
        call: InferenceCall,
        request: PickRequest,
        tier: str,
        failed: set[str],
        picks: list[_Pick],
    ) -> tuple[Replica, bool, AsyncGenerator[Chunk, None], Chunk]:
        """One try: pick, send, wait for the first chunk. A failed replica joins ``failed``."""
        decision = self.pick(request, picks)
        replica = self._replicas[decision.candidate.address]
        model, tokens = call.model, decision.uncached_tokens
        self._replicas.acquire(replica, model, tokens)
        stream = replica.link.generate(call)
        try:
            async with self._replicas.watched(replica):
                first = await _next_chunk(stream)
            first_tokens.start_sent()  # by now, whatever the link did
        except BaseException as err:
            # The books first: closing the stream may be interrupted (a second
            # cancellation), and a breaker's probe left without a verdict blocks it.
            self._replicas.first_chunk(replica, model, tokens, ok=False)
            self._replicas.release(replica, call.model)
            if isinstance(err, REPLICA_FAILURES):
                self._replicas.failed(replica, model, tier, err)
                failed.add(replica.address)
                self._attempted(model, replica, succeeded=False)
            else:  # the client went away, or the replica refused the request itself
                self._replicas.abandoned(replica, model)
            await stream.aclose()
            raise
        self._replicas.first_chunk(replica, model, tokens, ok=True)
        self._attempted(model, replica, succeeded=True)
        return replica, decision.fallback, stream, first

    def _attempted(self, model: str, replica: Replica, succeeded: bool) -> None:
        if self._watch is not None:
            self._watch.attempt(model, replica.endpoint.version, succeeded)


class _Pick(NamedTuple):
    decision: Decision
    seconds: float


def _count(picks: list[_Pick]) -> None:
    """The picks' metrics, and none of them twice."""
    for decision, seconds in picks:
        PICK_SECONDS.observe(seconds)
        for reason in decision.reasons:
            DECISIONS.labels(reason).inc()
        PICKS.labels(decision.candidate.address, decision.candidate.endpoint.version).inc()
    picks.clear()


async def _next_chunk(stream: AsyncIterator[Chunk]) -> Chunk:
    try:
        return await anext(stream)
    except StopAsyncIteration:
        raise Unavailable("inference replica ended the stream without a finish reason") from None


def _continuation(call: InferenceCall, sent_text: str, sent_tokens: int) -> InferenceCall:
    """The call that continues a broken stream: the text already sent becomes prompt, and
    the engine's penalties count it as output (all of it, over several resumes). The
    prompt's log probabilities and ids went with the first chunk: not asked again. A
    prompt of token ids goes on as text (the sent text's ids are not known here)."""
    sampling = replace(
        call.sampling.without_prompt_reports(),
        max_tokens=call.sampling.max_tokens - sent_tokens,
        min_tokens=max(0, call.sampling.min_tokens - sent_tokens),
    )
    return replace(
        call,
        prompt=call.prompt + sent_text,
        sampling=sampling,
        resumed_output_chars=call.resumed_output_chars + len(sent_text),
        prompt_ids=(),
    )


async def _pause_before_first_retry(retry_state: RetryCallState) -> None:
    """The pause before the first retry: the first attempt is made outside tenacity's
    loop, which pauses only between the attempts it makes."""
    if retry_state.attempt_number == 1:
        RETRIES.inc()
        await asyncio.sleep(RETRY_WAIT(retry_state))


def _past(deadline: float | None) -> bool:
    return deadline is not None and time.monotonic() >= deadline


class _deadline_reached(stop_base):  # noqa: N801 (named like tenacity's own stops)
    def __init__(self, deadline: float | None) -> None:
        self._deadline = deadline

    def __call__(self, retry_state: RetryCallState) -> bool:
        return _past(self._deadline)


def _weighted(split: Mapping[str, float]) -> frozenset[str]:
    """The subsets the split sends traffic to (empty: the split names none, so any)."""
    return frozenset(subset for subset, weight in split.items() if weight > 0)

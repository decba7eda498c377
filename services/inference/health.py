"""Whether each of Triton's models still answers, and bringing back one that does not.

Triton keeps reporting a model ready after its backend process died or hung: a dead
Python-backend stub fails new requests ("Stub process ... is not healthy") but leaves the
streams it had silent forever. So the inference service watches for itself:

- **Stalls**: while a model has generations in flight, some response must arrive within
  ``stall_s``; if none of them gets one, the model has stalled: every stream in flight is
  ended (UNAVAILABLE, which the router resumes elsewhere) and the model is failed.
- **Liveness probes**: a model with nothing in flight for ``probe_interval_s`` is sent a
  request its backend must refuse (``max_tokens: 0``); the refusal proves the backend
  process alive and answering, without touching the engine or its statistics. So is a
  model whose streams have all been quiet for ``quiet_probe_s`` (a second: many times an
  engine step), at most that often: a dead backend process fails the probe at once, and
  its streams end then, not at the stall time; a live one answers it (a long prefill).
- **Recovery**: a failed model is probed every ``RECHECK_S`` until it answers again, and
  reloaded through Triton's model control API (unload, then load: a new backend
  process) when a probe fails, at most once per backoff period. A model that comes back
  by itself (Triton restarted and loaded it) is not loaded a second time; a stalled one
  is reloaded at once (a probe of it would only wait out its timeout).

A failed model is refused at once here and named in load reports, so that routers stop
picking this replica for it (and only for it).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import math
import time
from collections.abc import AsyncIterator, Callable, Collection
from typing import Protocol

from prometheus_client import Counter, Gauge

from llmmesh.runtime.errors import Unavailable

log = logging.getLogger(__name__)

MODEL_FAILURES = Counter(
    "llm_inference_model_failures_total", "Models found not answering", ["model", "cause"]
)
MODEL_FAILED = Gauge("llm_inference_model_failed", "1 while a model is failed here", ["model"])


class EngineUnreachable(Unavailable):
    """The engine itself cannot be reached: no verdict on any of its models."""


RELOAD_BACKOFF_S = (1.0, 10.0)  # between reloads of a model that stays failed
RECHECK_S = 0.5  # between probes of a failed model


class ModelControl(Protocol):
    async def probe(self, model: str, timeout_s: float) -> None:
        """Returns if the model's backend answers; raises Unavailable if not."""
        ...

    async def reload(self, model: str) -> bool:
        """Asks Triton for a new instance of the model; False if Triton does not allow it."""
        ...


class ModelHealth:
    def __init__(self, stall_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.stall_s = stall_s
        self._clock = clock
        self.failed: dict[str, str] = {}  # Triton model -> why
        self.last_answer: dict[str, float] = {}  # Triton model -> when it last responded
        self._streams: dict[str, set[asyncio.Timeout]] = collections.defaultdict(set)
        self._why_ended: dict[str, str] = {}  # model -> why its streams were last ended
        self.changed = asyncio.Event()  # set on every failure and recovery

    def check(self, model: str) -> None:
        """UNAVAILABLE at once for a failed model (the router retries elsewhere)."""
        if model in self.failed:
            raise Unavailable(f"model '{model}' is not answering here ({self.failed[model]})")

    def in_flight(self, model: str) -> int:
        return len(self._streams.get(model, ()))

    @contextlib.asynccontextmanager
    async def watching(self, model: str) -> AsyncIterator[Callable[[], None]]:
        """Around one generation: yields the callback for each response; raises
        Unavailable when the model stalls."""
        streams = self._streams[model]
        if not streams:  # the model was idle: its stall clock starts now
            self.last_answer[model] = self._clock()
        try:
            async with asyncio.timeout(None) as deadline:
                streams.add(deadline)
                yield lambda: self.last_answer.__setitem__(model, self._clock())
        except TimeoutError:
            if not deadline.expired():
                raise
            raise Unavailable(f"model '{model}' {self._why_ended.get(model, 'stalled')}") from None
        finally:
            streams.discard(deadline)

    def stalled(self, after_s: float | None = None) -> list[str]:
        """Models with streams in flight and no response from any for ``after_s``
        (default: the stall time)."""
        now, quiet = self._clock(), self.stall_s if after_s is None else after_s
        return [
            model
            for model, streams in self._streams.items()
            if streams and now - self.last_answer.get(model, now) > quiet
        ]

    def end_streams(self, model: str, why: str = "") -> None:
        """Ends every generation of ``model`` in flight, each with UNAVAILABLE saying
        ``why`` (default: it stalled)."""
        self._why_ended[model] = why or f"stalled: no response in {self.stall_s:g} s"
        loop = asyncio.get_running_loop()
        for deadline in list(self._streams.get(model, ())):
            if deadline.when() is None:  # one being ended already may not be rescheduled
                deadline.reschedule(loop.time())

    def fail(self, model: str, cause: str) -> None:
        if model in self.failed:
            return
        self.failed[model] = cause
        MODEL_FAILURES.labels(model, cause).inc()
        MODEL_FAILED.labels(model).set(1)
        log.warning("model not answering", extra={"fields": {"model": model, "cause": cause}})
        self.changed.set()

    def recovered(self, model: str) -> None:
        if self.failed.pop(model, None) is not None:
            MODEL_FAILED.labels(model).set(0)
            self.last_answer[model] = self._clock()
            log.info("model answering again", extra={"fields": {"model": model}})
            self.changed.set()


class HealthKeeper:
    """The loops behind ModelHealth: the stall watchdog, the idle probes and recovery,
    for the models ``models()`` names (Triton's)."""

    def __init__(
        self,
        health: ModelHealth,
        control: ModelControl,
        models: Callable[[], Collection[str]],
        probe_interval_s: float,
        quiet_probe_s: float | None = None,
    ) -> None:
        self._health = health
        self._control = control
        self._models = models
        self._probe_interval = probe_interval_s
        self._quiet_probe = min(quiet_probe_s or probe_interval_s, probe_interval_s)
        self._probed_at: dict[str, float] = {}  # when each busy model was last probed
        self._tasks: list[asyncio.Task[None]] = []
        self._recovering: dict[str, asyncio.Task[None]] = {}
        self._suspects: dict[str, asyncio.Task[None]] = {}  # busy models being probed

    def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._watch_stalls()),
            asyncio.create_task(self._probe_idle()),
        ]

    async def close(self) -> None:
        tasks = [*self._tasks, *self._recovering.values(), *self._suspects.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def failed(self, model: str, cause: str, detail: str = "", *, hung: bool = False) -> None:
        """A model found not answering (``cause``: stalled, probe, backend process):
        failed, its streams in flight ended (none of them can finish on this instance),
        and brought back in the background."""
        if model not in self._health.failed:
            self._health.end_streams(model, f"stopped answering ({detail or cause})")
        self._health.fail(model, cause)
        if model not in self._recovering or self._recovering[model].done():
            self._recovering[model] = asyncio.create_task(self._recover(model, reload_now=hung))

    async def _watch_stalls(self) -> None:
        health = self._health
        period = min(health.stall_s, self._quiet_probe) / 4
        while True:
            await asyncio.sleep(period)  # the watchdog's period, not synchronisation
            for model in health.stalled():
                detail = f"stalled: no response in {health.stall_s:g} s"
                self.failed(model, "stalled", detail, hung=True)
            for model in health.stalled(after_s=self._quiet_probe):
                if self._may_probe_busy(model):
                    self._probed_at[model] = time.monotonic()
                    self._suspects[model] = asyncio.create_task(self._probe_busy(model))

    def _may_probe_busy(self, model: str) -> bool:
        """Not failed, not being probed, and not probed in the last ``quiet_probe_s``."""
        probing = self._suspects.get(model)
        recent = time.monotonic() - self._probed_at.get(model, -math.inf) < self._quiet_probe
        busy = probing is not None and not probing.done()
        return model not in self._health.failed and not busy and not recent

    async def _probe_busy(self, model: str) -> None:
        """A model whose streams all went quiet: if its backend does not answer a probe,
        its streams cannot go on either."""
        try:
            await self._control.probe(model, self._health.stall_s)
        except EngineUnreachable:
            return  # its streams break with the connection
        except Unavailable as err:
            self.failed(model, "probe", err.message)

    async def _probe_idle(self) -> None:
        health = self._health
        while True:
            await asyncio.sleep(self._probe_interval)  # the probe period
            now = time.monotonic()
            for model in self._models():
                idle = now - health.last_answer.get(model, 0.0) >= self._probe_interval
                if model in health.failed or health.in_flight(model) or not idle:
                    continue
                try:
                    await self._control.probe(model, health.stall_s)
                    health.last_answer[model] = time.monotonic()
                except EngineUnreachable:
                    continue  # the engine's outage, not the model's: load reports say so
                except Unavailable as err:
                    self.failed(model, "probe", err.message)

    async def _recover(self, model: str, *, reload_now: bool) -> None:
        delay, next_reload = RELOAD_BACKOFF_S[0], 0.0
        while model in self._health.failed:
            if not reload_now and await self._answers(model):
                self._health.recovered(model)
                return
            if reload_now or time.monotonic() >= next_reload:
                reloaded = await self._control.reload(model)
                log.info("model reload asked", extra={"fields": {"model": model, "ok": reloaded}})
                next_reload = time.monotonic() + delay
                delay = min(RELOAD_BACKOFF_S[1], delay * 2)
                reload_now = False
                continue  # probe the new instance at once
            await asyncio.sleep(RECHECK_S)  # the recheck period

    async def _answers(self, model: str) -> bool:
        try:
            await self._control.probe(model, self._health.stall_s)
        except Unavailable:
            return False
        return True

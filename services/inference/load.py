"""Load reporting: Triton's engine statistics plus this service's own, pushed to watchers.

The engine publishes its statistics as Triton custom metrics; the monitor reads them
(only while someone watches), adds this service's in-flight count and recent latencies,
and wakes every watcher when the load changes. Watchers also get a report at least every
interval, so a silent replica is distinguishable from an idle one.

While neither this service nor the engine has work, the monitor reads the engine's metrics
far less often, and again one polling period after a generation starts: an idle stack
otherwise spends its CPU serving and parsing metrics pages that say nothing new (on a
host the engine shares, CPU the engine could use).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import statistics
import time
from collections import deque
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field, replace

log = logging.getLogger(__name__)

_ENGINE_METRICS = {
    "llm_engine_running_sequences": "running",
    "llm_engine_waiting_sequences": "waiting",
    "llm_engine_kv_blocks_used": "kv_used",
    "llm_engine_kv_blocks_total": "kv_total",
    "llm_engine_prefix_cache_hit_rate": "prefix_hit_rate",
}


@dataclass(frozen=True)
class ModelLoad:
    model: str
    running: int = 0
    waiting: int = 0
    kv_utilization: float = 0.0
    prefix_cache_hit_rate: float = 0.0
    # Every gauge the engine exports for the model, named without ``llm_engine_``.
    metrics: Mapping[str, float] = field(default_factory=dict)
    failed: bool = False  # its instance stopped answering (services/inference/health.py)


@dataclass(frozen=True)
class LoadSnapshot:
    timestamp_ms: int = 0
    in_flight: int = 0
    recent_ttft_s: float = 0.0
    recent_tpot_s: float = 0.0
    models: tuple[ModelLoad, ...] = ()
    engine_reachable: bool = False

    def same_load(self, other: LoadSnapshot) -> bool:
        """Equal but for the time it was taken."""
        return replace(self, timestamp_ms=0) == replace(other, timestamp_ms=0)

    def busy(self) -> bool:
        """Work here or in the engine (an unreachable engine may come back with some)."""
        return (
            self.in_flight > 0
            or not self.engine_reachable
            or any(m.running or m.waiting for m in self.models)
        )


# One sample line of an engine family, e.g. `llm_engine_running_sequences{model="llm"} 3`,
# or of one by priority: `llm_engine_waiting_sequences_by_priority{model="llm",priority="2"}`.
_SAMPLE = re.compile(
    r'^(llm_engine_\w+)\{(?:[^}]*,)?model="([^"]+)"(?:,priority="(\d+)")?[^}]*\} (\S+)', re.M
)
_GAUGE = re.compile(r"^# TYPE (llm_engine_\w+) gauge$", re.M)
_PREFIX = len("llm_engine_")


def parse_engine_metrics(text: str) -> tuple[ModelLoad, ...]:
    """Per-model engine load from a Prometheus text exposition (Triton's /metrics).

    Read at 20 Hz per replica, so only the engine's sample lines are matched, directly:
    a general exposition parser costs a millisecond per read of Triton's whole page.
    """
    gauges = set(_GAUGE.findall(text))
    values: dict[str, dict[str, float]] = {}
    exported: dict[str, dict[str, float]] = {}
    for name, model, priority, value in _SAMPLE.findall(text):
        key = _ENGINE_METRICS.get(name)
        if key is not None and not priority:
            values.setdefault(model, {})[key] = float(value)
        if name in gauges:
            # A gauge by priority: one entry per priority (``waiting_sequences_by_priority.2``).
            exported_name = name[_PREFIX:] + (f".{priority}" if priority else "")
            exported.setdefault(model, {})[exported_name] = float(value)
    return tuple(
        ModelLoad(
            model=model,
            running=int(v.get("running", 0)),
            waiting=int(v.get("waiting", 0)),
            kv_utilization=v.get("kv_used", 0.0) / v["kv_total"] if v.get("kv_total") else 0.0,
            prefix_cache_hit_rate=v.get("prefix_hit_rate", 0.0),
            metrics=exported.get(model, {}),
        )
        for model, v in sorted(values.items())
    )


# The recent latencies' medians are taken at every load reading (20 a second): of the
# newest this many at most, so that their cost does not grow with the request rate.
RECENT_SAMPLES = 256


def _samples() -> deque[tuple[float, float]]:
    return deque(maxlen=RECENT_SAMPLES)


@dataclass
class RecentLatency:
    """Latencies of the requests finished in the last ``window_s`` seconds (the newest
    RECENT_SAMPLES of them)."""

    window_s: float = 30.0
    _ttft: deque[tuple[float, float]] = field(default_factory=_samples)
    _tpot: deque[tuple[float, float]] = field(default_factory=_samples)

    def add(self, ttft_s: float | None, tpot_s: float | None) -> None:
        now = time.monotonic()
        if ttft_s is not None:
            self._ttft.append((now, ttft_s))
        if tpot_s is not None:
            self._tpot.append((now, tpot_s))

    def medians(self) -> tuple[float, float]:
        cutoff = time.monotonic() - self.window_s
        for samples in (self._ttft, self._tpot):
            while samples and samples[0][0] < cutoff:
                samples.popleft()
        return _median(self._ttft), _median(self._tpot)


def _median(samples: deque[tuple[float, float]]) -> float:
    return statistics.median(v for _, v in samples) if samples else 0.0


class LoadMonitor:
    def __init__(
        self,
        read_engine_metrics: Callable[[], Awaitable[str]],
        in_flight: Callable[[], int],
        latency: RecentLatency,
        poll_interval_s: float = 0.05,
        idle_poll_interval_s: float = 1.0,
    ) -> None:
        self._read = read_engine_metrics
        self._in_flight = in_flight
        self._latency = latency
        self._interval = poll_interval_s
        self._idle_interval = max(idle_poll_interval_s, poll_interval_s)
        self._started = asyncio.Event()  # a generation started since the last idle read
        self._snapshot = LoadSnapshot()
        self._changed = asyncio.Condition()
        self._watchers = 0
        self._poller: asyncio.Task[None] | None = None
        self._ending = False
        self._wake_task: asyncio.Task[None] | None = None  # held: asyncio keeps weak refs

    async def watch(self, max_interval_s: float) -> AsyncGenerator[LoadSnapshot, None]:
        """The current load now, then on every change and at least every ``max_interval_s``,
        until ``end_watches``."""
        self._watchers += 1
        try:
            await self._refresh()
            while self._watching():
                if self._poller is None or self._poller.done():
                    self._poller = asyncio.create_task(self._poll())
                yield self._snapshot
                async with self._changed:
                    if self._watching():  # checked under the lock: its wake-up is not missed
                        with contextlib.suppress(TimeoutError):
                            await asyncio.wait_for(self._changed.wait(), max_interval_s)
        finally:
            self._watchers -= 1

    def end_watches(self) -> None:
        """Every watch ends now, for good (shutdown, once no generation is left). Its
        watcher (a router) takes the end as this replica gone, and the server's grace
        period does not wait on streams that would never end."""
        if self._ending:
            return
        self._ending = True
        self._wake_task = asyncio.get_running_loop().create_task(self._wake_watchers())

    def _watching(self) -> bool:
        # A call, not the attribute: mypy would keep the loop's test narrowed across awaits.
        return not self._ending

    async def _wake_watchers(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    def generation_started(self) -> None:
        """A generation starts here: an idle poller reads the engine's load again."""
        self._started.set()

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()

    async def _poll(self) -> None:
        while self._watchers > 0:
            self._started.clear()  # a start from now on, even during the read, is seen
            try:
                await self._refresh()
            except Exception:  # a poller that died would leave watchers its last snapshot
                log.exception("reading the engine's load failed")
            await self._until_next_read()

    async def _until_next_read(self) -> None:
        if self._snapshot.busy():
            await asyncio.sleep(self._interval)  # the polling period, not synchronisation
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._started.wait(), self._idle_interval)
            # Read one polling period after the start, as when busy: a read at once would
            # compete with the generation's prefill for the CPU.
            await asyncio.sleep(self._interval)

    async def _refresh(self) -> None:
        try:
            models, reachable = parse_engine_metrics(await self._read()), True
        except (OSError, ValueError):
            models, reachable = (), False
        ttft, tpot = self._latency.medians()
        snapshot = LoadSnapshot(
            timestamp_ms=int(time.time() * 1000),
            in_flight=self._in_flight(),
            recent_ttft_s=ttft,
            recent_tpot_s=tpot,
            models=models,
            engine_reachable=reachable,
        )
        changed = not snapshot.same_load(self._snapshot)
        self._snapshot = snapshot
        if changed:
            await self._wake_watchers()

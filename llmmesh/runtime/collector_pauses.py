"""Python's cyclic garbage collector in a long-running service: the heap built at start
frozen out of its reach, and the time it stops the process counted.

A service imports gRPC, protobuf, pydantic and the rest, compiles its rules and builds its
tables before it serves: about 150,000 objects that live as long as the process. Every
full collection walks all of them again (tens of ms on these machines), each one a pause
of every stream the process relays; ``gc.freeze()`` once the service is up moves them to
a generation the collector never scans, as vLLM's API server does after its start-up.
"""

from __future__ import annotations

import functools
import gc
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import REGISTRY
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

GENERATIONS = 3


class PauseClock:
    """Seconds each generation's collections took, from ``gc.callbacks``.

    Plain floats, no lock: the callback runs inside a collection, which any allocation
    can start, also one made while a Prometheus metric holds its lock; taking that lock
    here could deadlock the thread on itself."""

    def __init__(self) -> None:
        self.seconds = [0.0] * GENERATIONS
        self.longest = [0.0] * GENERATIONS
        self._started = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        generation = int(info.get("generation", 0))
        took = time.perf_counter() - self._started
        self.seconds[generation] += took
        self.longest[generation] = max(self.longest[generation], took)


class PauseCollector(Collector):
    """Exports a clock's totals at scrape time."""

    def __init__(self, clock: PauseClock) -> None:
        self._clock = clock

    def collect(self) -> Iterator[Metric]:
        total = CounterMetricFamily(
            "llm_gc_pause_seconds",
            "Time the cyclic garbage collector stopped this process, by generation",
            labels=["generation"],
        )
        longest = GaugeMetricFamily(
            "llm_gc_longest_pause_seconds",
            "The longest single collection so far, by generation",
            labels=["generation"],
        )
        for generation in range(GENERATIONS):
            total.add_metric([str(generation)], self._clock.seconds[generation])
            longest.add_metric([str(generation)], self._clock.longest[generation])
        yield total
        yield longest


@functools.cache
def watch_pauses() -> PauseClock:
    """Counts every collection's pause in this process (``llm_gc_pause_seconds_total``);
    once per process, however often called."""
    clock = PauseClock()
    gc.callbacks.append(clock)
    REGISTRY.register(PauseCollector(clock))
    return clock


def freeze_startup_heap() -> int:
    """Collects what start-up left over, then freezes every object still alive out of the
    collector's reach; returns how many were frozen. Once per process, after start-up:
    a later freeze would also keep whatever garbage cycles exist at that moment."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()

"""The collector's pauses counted, and the start-up heap frozen out of its reach."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from llmmesh.runtime.collector_pauses import PauseClock, PauseCollector, freeze_startup_heap


@pytest.fixture
def clock() -> Iterator[PauseClock]:
    clock = PauseClock()
    gc.callbacks.append(clock)
    yield clock
    gc.callbacks.remove(clock)


class Node:
    other: Node


def _cycle() -> weakref.ref[Node]:
    a, b = Node(), Node()
    a.other, b.other = b, a
    return weakref.ref(a)


def test_a_full_collection_is_timed_under_its_generation(clock: PauseClock) -> None:
    gc.collect(2)
    assert clock.seconds[2] > 0
    assert clock.longest[2] == pytest.approx(clock.seconds[2])
    gc.collect(0)
    assert clock.seconds[0] > 0


def test_the_collector_exports_totals_and_the_longest_pause(clock: PauseClock) -> None:
    gc.collect(2)
    gc.collect(2)
    registry = CollectorRegistry()
    registry.register(PauseCollector(clock))
    page = generate_latest(registry).decode()
    total = registry.get_sample_value("llm_gc_pause_seconds_total", {"generation": "2"})
    longest = registry.get_sample_value("llm_gc_longest_pause_seconds", {"generation": "2"})
    assert total == pytest.approx(clock.seconds[2])
    assert total is not None and longest is not None
    assert 0 < longest < total
    assert 'llm_gc_pause_seconds_total{generation="0"}' in page


def _in_reach(target: object) -> bool:
    """Whether the collector still looks at ``target`` (frozen objects are not listed)."""
    return any(found is target for found in gc.get_objects())


def test_freezing_keeps_alive_objects_out_of_reach_and_still_collects_new_cycles() -> None:
    # Compared by identity, not by the frozen count: a frozen object that another thread
    # lets go of leaves the count at once.
    alive_at_start = [Node()]
    try:
        assert freeze_startup_heap() > 10_000
        assert not _in_reach(alive_at_start)
        orphan = _cycle()
        gc.collect()
        assert orphan() is None  # a cycle made after the freeze is still collected
        assert not _in_reach(alive_at_start)  # and a collection thaws nothing
    finally:
        gc.unfreeze()
    assert _in_reach(alive_at_start)

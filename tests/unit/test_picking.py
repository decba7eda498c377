from __future__ import annotations

import random
import time
from collections import Counter

from services.router.picking import (
    EndpointView,
    LeastLoadedPicker,
    ReportedLoad,
    RoundRobinPicker,
    views,
)


def test_round_robin_takes_turns() -> None:
    picker = RoundRobinPicker()
    candidates = [EndpointView(a, 0, None) for a in ("a", "b", "c")]
    assert [picker.pick(candidates) for _ in range(6)] == ["a", "b", "c", "a", "b", "c"]


def test_least_loaded_prefers_short_queues_and_free_cache() -> None:
    picker = LeastLoadedPicker()
    candidates = [
        EndpointView("queued", 0, ReportedLoad(running=4, waiting=3)),
        EndpointView("full-cache", 0, ReportedLoad(running=4, kv_utilization=0.95)),
        EndpointView("fine", 0, ReportedLoad(running=5, kv_utilization=0.2)),
    ]
    assert picker.pick(candidates) == "fine"


def test_in_flight_spreads_a_burst_between_reports() -> None:
    picker = LeastLoadedPicker()
    in_flight: Counter[str] = Counter()
    reports = {a: ReportedLoad() for a in ("a", "b")}
    for _ in range(10):
        in_flight[picker.pick(views(["a", "b"], in_flight, reports, 1.0))] += 1
    assert in_flight == Counter({"a": 5, "b": 5})


def test_ties_are_broken_at_random() -> None:
    picker = LeastLoadedPicker(rng=random.Random(1))
    candidates = [EndpointView(a, 0, ReportedLoad()) for a in ("a", "b", "c")]
    assert {picker.pick(candidates) for _ in range(50)} == {"a", "b", "c"}


def test_stale_reports_are_ignored() -> None:
    old = ReportedLoad(waiting=100, received_at=time.monotonic() - 10)
    (view,) = views(["a"], {}, {"a": old}, stale_after_s=1.0)
    assert view.report is None

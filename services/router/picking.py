"""Endpoint picking: which inference replica serves a request.

Pickers see the candidates and what is known of their load: the replica's last pushed
load report plus the router's own in-flight count, which moves between reports.
"""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class ReportedLoad:
    """A replica's engine load for one model, as its last load report gave it."""

    running: int = 0
    waiting: int = 0
    kv_utilization: float = 0.0
    received_at: float = field(default_factory=time.monotonic)


@dataclass(frozen=True)
class EndpointView:
    address: str
    in_flight: int  # requests this router is streaming from it now
    report: ReportedLoad | None  # None until a report arrived (or after it went stale)


class Picker(Protocol):
    def pick(self, candidates: Sequence[EndpointView]) -> str: ...


class RoundRobinPicker:
    """The baseline: every endpoint in turn, blind to load."""

    def __init__(self) -> None:
        self._counter = itertools.count()

    def pick(self, candidates: Sequence[EndpointView]) -> str:
        return candidates[next(self._counter) % len(candidates)].address


@dataclass(frozen=True)
class LoadWeights:
    waiting: float = 4.0  # a queued request waits for a slot: the costliest signal
    running: float = 1.0
    kv_utilization: float = 8.0  # a full cache means preemption or waiting
    in_flight: float = 1.0


class LeastLoadedPicker:
    """Lowest weighted load wins; ties are broken at random. Between reports, the
    router's own in-flight count keeps a burst from landing on one replica."""

    def __init__(self, weights: LoadWeights | None = None, rng: random.Random | None = None):
        self._weights = weights or LoadWeights()
        self._rng = rng or random.Random()

    def score(self, endpoint: EndpointView) -> float:
        w, report = self._weights, endpoint.report
        score = w.in_flight * endpoint.in_flight
        if report is not None:
            score += (
                w.waiting * report.waiting
                + w.running * report.running
                + w.kv_utilization * report.kv_utilization
            )
        return score

    def pick(self, candidates: Sequence[EndpointView]) -> str:
        scores = [self.score(c) for c in candidates]
        best = min(scores)
        return self._rng.choice(
            [c for c, s in zip(candidates, scores, strict=True) if s == best]
        ).address


PICKERS = {"least_loaded": LeastLoadedPicker, "round_robin": RoundRobinPicker}


def fresh(report: ReportedLoad | None, stale_after_s: float, now: float) -> ReportedLoad | None:
    """The report, unless it is older than ``stale_after_s``."""
    return report if report is not None and now - report.received_at <= stale_after_s else None


def views(
    addresses: Sequence[str],
    in_flight: Mapping[str, int],
    reports: Mapping[str, ReportedLoad],
    stale_after_s: float,
) -> list[EndpointView]:
    now = time.monotonic()
    return [
        EndpointView(a, in_flight.get(a, 0), fresh(reports.get(a), stale_after_s, now))
        for a in addresses
    ]

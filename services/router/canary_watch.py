"""What the canary analysis reads from a router: per model and subset, the real traffic's
TTFT and TPOT and the attempts that failed; per mirrored subset, the drift of each pair of
answers; the shadows sent and dropped. Each kept in a bounded ring with its time, so that
the rollout controller can ask for what came since its step began
(``GET /internal/canary?since=...``, services/router/openai_api.py), and sum what several
routers saw.
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict, deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from prometheus_client import Counter as PromCounter
from prometheus_client import Histogram

from llmmesh.analysis.drift import DriftWindow, PairDiff

SHADOWS = PromCounter(
    "llm_canary_shadows_total",
    "Mirrored requests, by what became of them",
    ["model", "subset", "outcome"],
)
PAIR_KL = Histogram(
    "llm_canary_pair_kl",
    "Mean KL divergence per compared position of a stable/shadow pair",
    ["model", "subset"],
    buckets=(0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0),
)
PAIR_AGREEMENT = Histogram(
    "llm_canary_pair_agreement",
    "Share of a pair's compared positions whose top-1 tokens agree",
    ["model", "subset"],
    buckets=(0.5, 0.8, 0.9, 0.95, 0.99, 1.0),
)
KEEP = 20_000  # samples per ring: more than a rollout step of any test or benchmark


def _ring() -> deque[Any]:
    return deque(maxlen=KEEP)


@dataclass
class _Traffic:
    ttft: deque[tuple[float, float]] = field(default_factory=_ring)  # (time, seconds)
    tpot: deque[tuple[float, float]] = field(default_factory=_ring)
    attempts: deque[tuple[float, bool]] = field(default_factory=_ring)  # (time, succeeded)


class CanaryWatch:
    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._traffic: defaultdict[tuple[str, str], _Traffic] = defaultdict(_Traffic)
        self._pairs: defaultdict[tuple[str, str], deque[tuple[float, PairDiff]]] = defaultdict(
            _ring
        )
        self._shadows: Counter[tuple[str, str, str]] = Counter()

    def stream(self, model: str, subset: str, ttft_s: float, tpot_s: float | None) -> None:
        """A client's stream that ended (its subset is the one that served it)."""
        now, traffic = self._clock(), self._traffic[model, subset]
        traffic.ttft.append((now, ttft_s))
        if tpot_s is not None:
            traffic.tpot.append((now, tpot_s))

    def attempt(self, model: str, subset: str, succeeded: bool) -> None:
        """An attempt on a replica of ``subset``: its first chunk came, or it failed."""
        self._traffic[model, subset].attempts.append((self._clock(), succeeded))

    def pair(self, model: str, subset: str, diff: PairDiff) -> None:
        self._pairs[model, subset].append((self._clock(), diff))
        if diff.positions:
            n = len(diff.positions)
            PAIR_KL.labels(model, subset).observe(sum(p.kl for p in diff.positions) / n)
            agree = sum(p.agree for p in diff.positions) / n
            PAIR_AGREEMENT.labels(model, subset).observe(agree)

    def shadow(self, model: str, subset: str, outcome: str) -> None:
        self._shadows[model, subset, outcome] += 1
        SHADOWS.labels(model, subset, outcome).inc()

    def snapshot(self, since: float = 0.0) -> dict[str, Any]:
        """Everything recorded at or after ``since`` (Unix seconds), as JSON: per model,
        per subset its samples and attempt counts, per mirrored subset the drift sums
        (a DriftWindow: sums, so that several routers' add up)."""
        models: dict[str, Any] = defaultdict(lambda: {"subsets": {}, "drift": {}})
        for (model, subset), traffic in self._traffic.items():
            attempts = [ok for at, ok in traffic.attempts if at >= since]
            models[model]["subsets"][subset] = {
                "ttft_s": [v for at, v in traffic.ttft if at >= since],
                "tpot_s": [v for at, v in traffic.tpot if at >= since],
                "attempts": len(attempts),
                "errors": attempts.count(False),
            }
        for (model, subset), pairs in self._pairs.items():
            window = DriftWindow()
            for at, diff in pairs:
                if at >= since:
                    window.add(diff)
            models[model]["drift"][subset] = asdict(window)
        shadows: dict[str, dict[str, dict[str, int]]] = defaultdict(lambda: defaultdict(dict))
        for (model, subset, outcome), count in self._shadows.items():
            shadows[model][subset][outcome] = count
        return {"now": self._clock(), "since": since, "models": models, "shadows": shadows}

"""Per-request records and their summary, defined as vLLM's `bench serve` and GenAI-Perf do.

TTFT: request sent -> first non-empty text. ITL: gaps between successive text chunks.
TPOT: (E2E - TTFT) / (output tokens - 1), per request. Goodput: requests per second that
met every SLO given.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import asdict, dataclass, field
from typing import Any

PERCENTILES = (50, 90, 99)


@dataclass
class RequestRecord:
    sent_at: float
    first_token_at: float = 0.0
    finished_at: float = 0.0
    output_tokens: int = 0
    chunk_times: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error and self.first_token_at > 0

    @property
    def ttft(self) -> float:
        return self.first_token_at - self.sent_at

    @property
    def e2e(self) -> float:
        return self.finished_at - self.sent_at

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.finished_at - self.first_token_at) / (self.output_tokens - 1)

    def itls(self) -> list[float]:
        times = self.chunk_times
        return [b - a for a, b in itertools.pairwise(times)]


@dataclass(frozen=True)
class Slo:
    ttft_s: float | None = None
    tpot_s: float | None = None

    def met(self, record: RequestRecord) -> bool:
        if not record.ok:
            return False
        if self.ttft_s is not None and record.ttft > self.ttft_s:
            return False
        tpot = record.tpot
        return self.tpot_s is None or tpot is None or tpot <= self.tpot_s


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default method)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def _dist(values: list[float]) -> dict[str, float]:
    out = {f"p{q}": percentile(values, q) for q in PERCENTILES}
    out["mean"] = sum(values) / len(values) if values else math.nan
    return out


@dataclass
class Summary:
    requests: int
    failed: int
    duration_s: float
    output_tokens: int
    output_tokens_per_s: float
    requests_per_s: float
    goodput_per_s: float
    ttft_s: dict[str, float]
    tpot_s: dict[str, float]
    itl_s: dict[str, float]
    e2e_s: dict[str, float]
    errors: list[str]

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def summarize(records: list[RequestRecord], duration_s: float, slo: Slo) -> Summary:
    ok = [r for r in records if r.ok]
    tokens = sum(r.output_tokens for r in ok)
    return Summary(
        requests=len(records),
        failed=len(records) - len(ok),
        duration_s=duration_s,
        output_tokens=tokens,
        output_tokens_per_s=tokens / duration_s if duration_s else 0.0,
        requests_per_s=len(ok) / duration_s if duration_s else 0.0,
        goodput_per_s=sum(slo.met(r) for r in records) / duration_s if duration_s else 0.0,
        ttft_s=_dist([r.ttft for r in ok]),
        tpot_s=_dist([t for r in ok if (t := r.tpot) is not None]),
        itl_s=_dist([gap for r in ok for gap in r.itls()]),
        e2e_s=_dist([r.e2e for r in ok]),
        errors=sorted({r.error for r in records if r.error})[:5],
    )

"""Targeted engine benchmarks, each measuring a ratio in one run against one target.

- ``hol``: time to first token of short requests arriving while long generations run,
  against the same requests on an idle engine (head-of-line blocking).
- ``prefix``: time to first token of prompts whose first 90% is already in the prefix
  cache, against prompts of the same length that share nothing.
- ``paired``: two targets' time to first token, request by request in pairs (the HTTP
  API against gRPC: a difference of a millisecond, which separate runs cannot resolve).
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from dataclasses import dataclass

import numpy as np
from scipy import stats

from bench.metrics import RequestRecord
from bench.targets import Target
from bench.workload import BenchRequest, new_salt, text_of_length


@dataclass(frozen=True)
class Comparison:
    name: str
    baseline_label: str
    baseline_s: list[float]
    candidate_label: str
    candidate_s: list[float]

    @property
    def ratio(self) -> float:
        """Candidate p50 / baseline p50."""
        return statistics.median(self.candidate_s) / statistics.median(self.baseline_s)

    def table(self) -> str:
        def p(values: list[float], q: int) -> str:
            ordered = sorted(values)
            return f"{ordered[min(len(ordered) - 1, len(ordered) * q // 100)] * 1000:.1f}"

        rows = [
            "| case | requests | TTFT p50 (ms) | TTFT p90 (ms) |",
            "| --- | --- | --- | --- |",
        ]
        for label, values in (
            (self.baseline_label, self.baseline_s),
            (self.candidate_label, self.candidate_s),
        ):
            rows.append(f"| {label} | {len(values)} | {p(values, 50)} | {p(values, 90)} |")
        return "\n".join(rows)


async def _ttft(target: Target, request: BenchRequest) -> float:
    record = RequestRecord(sent_at=time.perf_counter())
    await target.send(request, record)
    return record.ttft


async def head_of_line(
    target: Target,
    *,
    probes: int = 16,
    busy: int = 15,
    prompt_len: int = 128,
    busy_tokens: int = 1500,
    seed: int = 0,
) -> Comparison:
    rng = random.Random(seed)

    def probe() -> BenchRequest:
        salt = new_salt()
        return BenchRequest(salt + text_of_length(rng, prompt_len - len(salt)), max_tokens=4)

    idle = [await _ttft(target, probe()) for _ in range(probes)]
    long_runs = [
        asyncio.create_task(
            target.send(
                BenchRequest(text_of_length(rng, prompt_len), busy_tokens),
                RequestRecord(sent_at=time.perf_counter()),
            )
        )
        for _ in range(busy)
    ]
    try:
        await asyncio.sleep(1.0)  # workload shape: let the long generations reach decode
        loaded = [await _ttft(target, probe()) for _ in range(probes)]
    finally:
        for task in long_runs:
            task.cancel()
        await asyncio.gather(*long_runs, return_exceptions=True)
    return Comparison("hol", "idle engine", idle, f"{busy} long generations running", loaded)


async def prefix_cache(
    target: Target,
    trials: int = 16,
    prompt_len: int = 1024,
    cached_share: float = 0.9,
    seed: int = 0,
) -> Comparison:
    rng = random.Random(seed)
    prefix_len = int(prompt_len * cached_share)
    cached, uncached = [], []
    for _ in range(trials):
        prefix = new_salt() + text_of_length(rng, prefix_len)
        await _ttft(target, BenchRequest(prefix + text_of_length(rng, prompt_len - prefix_len), 1))
        cached.append(
            await _ttft(
                target, BenchRequest(prefix + text_of_length(rng, prompt_len - prefix_len), 4)
            )
        )
        fresh = new_salt() + text_of_length(rng, prompt_len)
        uncached.append(await _ttft(target, BenchRequest(fresh, 4)))
    return Comparison(
        "prefix", "uncached prompt", uncached, f"first {cached_share:.0%} cached", cached
    )


@dataclass(frozen=True)
class Paired:
    """Two targets' TTFT, request by request in pairs: each pair the same prompt length
    (a fresh prefix each, so neither reads the other's cache), the order alternating, so
    the machine's drift falls on both alike. The difference is judged per pair."""

    baseline_label: str
    candidate_label: str
    baseline_s: list[float]
    candidate_s: list[float]

    @property
    def differences_s(self) -> list[float]:
        return [c - b for b, c in zip(self.baseline_s, self.candidate_s, strict=True)]

    def median_difference_ci(self, confidence: float = 0.95) -> tuple[float, float, float]:
        """The median of the per-pair differences and its bootstrap interval."""
        differences = np.array(self.differences_s)
        interval = stats.bootstrap(
            (differences,), np.median, confidence_level=confidence, random_state=0
        ).confidence_interval
        return float(np.median(differences)), interval.low, interval.high

    def table(self) -> str:
        median, low, high = (v * 1000 for v in self.median_difference_ci())
        rows = [
            "| target | requests | TTFT p50 (ms) | TTFT p90 (ms) |",
            "| --- | --- | --- | --- |",
        ]
        for label, values in (
            (self.baseline_label, self.baseline_s),
            (self.candidate_label, self.candidate_s),
        ):
            p50, p90 = np.percentile(values, [50, 90]) * 1000
            rows.append(f"| {label} | {len(values)} | {p50:.2f} | {p90:.2f} |")
        summary = (
            f"Median of the per-pair differences ({self.candidate_label} - "
            f"{self.baseline_label}): {median:+.2f} ms, 95% bootstrap interval "
            f"[{low:+.2f}, {high:+.2f}] ms, over {len(self.baseline_s)} pairs."
        )
        return "\n".join(rows) + "\n\n" + summary


async def paired_ttft(
    baseline: Target,
    candidate: Target,
    *,
    pairs: int = 200,
    prompt_len: int = 128,
    max_tokens: int = 4,
    seed: int = 0,
) -> Paired:
    rng = random.Random(seed)

    def request() -> BenchRequest:
        salt = new_salt()
        return BenchRequest(salt + text_of_length(rng, prompt_len - len(salt)), max_tokens)

    first, second = [], []
    for i in range(pairs):
        ordered = (baseline, candidate) if i % 2 == 0 else (candidate, baseline)
        times = {id(target): await _ttft(target, request()) for target in ordered}
        first.append(times[id(baseline)])
        second.append(times[id(candidate)])
    return Paired(baseline.name, candidate.name, first, second)

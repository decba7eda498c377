"""Targeted engine benchmarks, each measuring a ratio in one run against one target.

- ``hol``: time to first token of short requests arriving while long generations run,
  against the same requests on an idle engine (head-of-line blocking).
- ``prefix``: time to first token of prompts whose first 90% is already in the prefix
  cache, against prompts of the same length that share nothing.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from dataclasses import dataclass

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

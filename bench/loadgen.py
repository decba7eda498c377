"""Drives a target with a workload: closed-loop concurrency or open-loop Poisson arrivals."""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass
from typing import Any

import grpc
from tqdm import tqdm

from bench.metrics import RequestRecord, Slo, Summary, summarize
from bench.targets import Target
from bench.workload import BenchRequest, new_salt


@dataclass(frozen=True)
class LoadShape:
    """Exactly one of: ``concurrency`` (closed loop) or ``rate`` (Poisson, requests/s)."""

    concurrency: int | None = None
    rate: float | None = None
    seed: int = 0

    def label(self) -> str:
        return f"concurrency {self.concurrency}" if self.concurrency else f"rate {self.rate}/s"


async def send_one(target: Target, request: BenchRequest, bar: tqdm[Any] | None) -> RequestRecord:
    record = RequestRecord(sent_at=time.perf_counter())
    try:
        await target.send(request, record)
    except Exception as exc:  # a failed request is a data point, not the end of the run
        details = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
        record.error = f"{type(exc).__name__}: {details}"
        record.finished_at = time.perf_counter()  # when the answer (an error) came
    if bar is not None:
        bar.update(1)
    return record


async def _closed_loop(
    target: Target, requests: list[BenchRequest], concurrency: int, bar: tqdm[Any] | None
) -> list[RequestRecord]:
    pending = list(reversed(requests))
    records: list[RequestRecord] = []

    async def worker() -> None:
        while pending:
            records.append(await send_one(target, pending.pop(), bar))

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return records


async def _open_loop(
    target: Target, requests: list[BenchRequest], rate: float, seed: int, bar: tqdm[Any] | None
) -> list[RequestRecord]:
    rng = random.Random(seed)
    tasks = []
    next_at = time.perf_counter()
    for request in requests:
        delay = next_at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)  # arrival schedule, not synchronisation
        tasks.append(asyncio.create_task(send_one(target, request, bar)))
        next_at += rng.expovariate(rate)
    return list(await asyncio.gather(*tasks))


@dataclass
class Measurement:
    """Records of one or more runs of a target at one load, pooled."""

    records: list[RequestRecord]
    duration_s: float

    def add(self, other: Measurement) -> None:
        self.records += other.records
        self.duration_s += other.duration_s

    def summary(self, slo: Slo) -> Summary:
        return summarize(self.records, self.duration_s, slo)


async def run_load(
    target: Target,
    requests: list[BenchRequest],
    shape: LoadShape,
    *,
    warmup: int = 2,
    progress: bool = True,
) -> Measurement:
    """Warms up with ``warmup`` requests, then measures the whole workload."""
    for request in requests[:warmup]:  # other prompts: warm-up must not fill the prefix cache
        await send_one(target, BenchRequest(new_salt() + request.prompt, request.max_tokens), None)
    # disable=None: no bar when stderr is not a terminal (CI logs).
    bar = tqdm(
        total=len(requests),
        desc=f"{target.name} {shape.label()}",
        disable=None if progress else True,
    )
    started = time.perf_counter()
    try:
        if shape.concurrency:
            records = await _closed_loop(target, requests, shape.concurrency, bar)
        elif shape.rate:
            records = await _open_loop(target, requests, shape.rate, shape.seed, bar)
        else:
            raise ValueError("LoadShape needs a concurrency or a rate")
    finally:
        bar.close()
    return Measurement(records, time.perf_counter() - started)

"""Load rounds: every target at every load of a run's arguments, the targets' order
alternating from round to round, and the CPU their processes spent."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import replace

from bench.cpu import CpuMeter, CpuSpent
from bench.loadgen import LoadShape, Measurement, run_load
from bench.metrics import Slo
from bench.recording import workload_of
from bench.report import Run, path_cpu_ms
from bench.targets import Target
from bench.workload import make_requests, new_salt


async def run_all(
    args: argparse.Namespace,
    targets: list[Target],
    meters: Mapping[str, CpuMeter] | None = None,
) -> list[Run]:
    """Every target at every load, rounds alternating; ``meters``: per target, the CPU
    groups of the processes that serve it."""
    spec = workload_of(args)
    slo = Slo(
        ttft_s=args.ttft_slo_ms / 1000 if args.ttft_slo_ms else None,
        tpot_s=args.tpot_slo_ms / 1000 if args.tpot_slo_ms else None,
    )
    shapes = (
        [LoadShape(rate=args.rate, seed=args.seed)]
        if args.rate
        else [LoadShape(concurrency=int(c)) for c in args.concurrency.split(",")]
    )
    order = {target.name: i for i, target in enumerate(targets)}
    pooled: dict[tuple[int, str], Measurement] = {}
    spent: dict[tuple[int, str], CpuSpent] = {}
    per_round: dict[tuple[int, str], list[float]] = {}
    with_idle: dict[tuple[int, str], list[float]] = {}
    meters = meters or {}
    idle = {id(m): m.idle() for m in {id(m): m for m in meters.values()}.values()}
    try:
        for round_index in range(args.rounds):
            for index, shape in enumerate(shapes):
                # Alternate the order so that neither target always runs second.
                flip = (round_index + index) % 2 == 1
                for target in reversed(targets) if flip else targets:
                    # Same lengths and words for every target, but a fresh salt: the
                    # engine's prefix cache must not favour whichever target runs second.
                    requests = make_requests(replace(spec, salt=new_salt()))
                    meter = meters.get(target.name)
                    before = meter.sample() if meter is not None else None
                    measured = await run_load(
                        target, requests, shape, warmup=args.warmup, progress=not args.no_progress
                    )
                    key = (index, target.name)
                    if meter is not None and before is not None:
                        whole = meter.sample().minus(before)
                        cost = whole.beyond(idle[id(meter)])
                        spent[key] = spent[key].plus(cost) if key in spent else cost
                        summary = measured.summary(slo)
                        done = summary.requests - summary.failed
                        per_round.setdefault(key, []).append(path_cpu_ms(cost, done))
                        with_idle.setdefault(key, []).append(path_cpu_ms(whole, done))
                    if key in pooled:
                        pooled[key].add(measured)
                    else:
                        pooled[key] = measured
    finally:
        for target in targets:
            await target.close()
    return [
        Run(
            name,
            shapes[index].label(),
            shapes[index].concurrency,
            measured.summary(slo),
            measured.records,
            spent.get((index, name)),
            per_round.get((index, name), []),
            idle[id(meters[name])] if name in meters else None,
            with_idle.get((index, name), []),
        )
        for (index, name), measured in sorted(
            pooled.items(), key=lambda kv: (kv[0][0], order[kv[0][1]])
        )
    ]

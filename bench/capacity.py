"""The router's capacity (``llm-mesh bench --scenario capacity``): the requests a second
one router process admits and picks, and the tokens a second it relays, on one CPU,
before its own latency doubles. The figure that says how many routers a fleet needs.

The upstream is never the bottleneck: paced replicas (bench/paced_replica.py, the real
inference service over a step clock) answer every request after ``ttft_ms`` and give
each running sequence a token every ``itl_ms``, however many there are. The router runs
alone on the first CPU; the paced replicas, the stack's services and this load generator
share the others. The tenant is the local stack's (the default rule set: the prompt is
checked, and the output as it streams), with no budgets, and admission control's window
wide enough never to queue: what is measured is the router's own work.

Two sweeps, each step a fresh measurement: requests a second (Poisson arrivals of short
generations, ``short_tokens`` each), and concurrent streams (closed loop, long
generations): each step's TTFT p50 against the first step's, the router's CPU use, and
what it served. The capacity is the highest step whose TTFT p50 stays within twice the
first step's, with nothing failed.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from bench.cpu import CpuMeter, pin
from bench.loadgen import LoadShape, run_load
from bench.metrics import Slo
from bench.targets import RouterTarget
from bench.workload import WorkloadSpec, make_requests, new_salt
from llmmesh.launcher import Stack, StackPorts
from llmmesh.launcher.process import Child

LATENCY_GROWTH = 2.0  # "before its own latency doubles"


@dataclass(frozen=True)
class CapacityShape:
    replicas: int = 2
    ttft_ms: float = 5.0
    itl_ms: float = 10.0
    rates: tuple[float, ...] = (25, 100, 200, 300, 400, 500, 600, 800)
    rate_seconds: float = 8.0
    short_tokens: int = 4
    streams: tuple[int, ...] = (4, 16, 32, 64, 128, 192, 256)
    stream_tokens: int = 200
    stream_seconds: float = 8.0
    prompt_chars: int = 128


@dataclass(frozen=True)
class Step:
    load: str  # "100 req/s" or "64 streams"
    offered: float  # requests/s, or streams
    served_per_s: float  # requests/s done
    tokens_per_s: float  # relayed to the clients
    responses_per_s: float  # messages with text the clients received
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    router_cpu: float  # the router's share of its CPU over the step
    failed: int

    def row(self, base_ttft_ms: float) -> str:
        growth = self.ttft_p50_ms / base_ttft_ms if base_ttft_ms else math.inf
        return (
            f"| {self.load} | {self.served_per_s:.0f} | {self.tokens_per_s:,.0f} | "
            f"{self.responses_per_s:,.0f} | {self.ttft_p50_ms:.1f} | {self.ttft_p99_ms:.1f} | "
            f"{growth:.2f}x | {self.itl_p50_ms:.1f} | {self.router_cpu:.0%} | {self.failed} |"
        )


@dataclass(frozen=True)
class Sweep:
    name: str
    steps: list[Step]

    def within(self) -> Step | None:
        """The highest step whose TTFT p50 is within LATENCY_GROWTH x the first's."""
        base = self.steps[0].ttft_p50_ms
        kept = [s for s in self.steps if not s.failed and s.ttft_p50_ms <= LATENCY_GROWTH * base]
        return kept[-1] if kept else None

    def table(self) -> str:
        base = self.steps[0].ttft_p50_ms
        head = (
            f"| {self.name} | requests/s | tokens/s | responses/s | TTFT p50 (ms) | "
            "TTFT p99 (ms) | TTFT p50 / first | ITL p50 (ms) | router CPU | failed |\n"
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
        )
        return "\n".join([head, *(s.row(base) for s in self.steps)])


@dataclass(frozen=True)
class Capacity:
    shape: CapacityShape
    placement: str
    rates: Sweep
    streams: Sweep

    def report(self) -> str:
        best_rate, best_streams = self.rates.within(), self.streams.within()
        said = []
        if best_rate is not None:
            said.append(
                f"**{best_rate.served_per_s:.0f} requests/s** admitted and picked "
                f"(TTFT p50 {best_rate.ttft_p50_ms:.1f} ms, router CPU {best_rate.router_cpu:.0%})"
            )
        if best_streams is not None:
            said.append(
                f"**{best_streams.tokens_per_s:,.0f} tokens/s** relayed over "
                f"{best_streams.load} (TTFT p50 {best_streams.ttft_p50_ms:.1f} ms, "
                f"{best_streams.responses_per_s:,.0f} responses/s)"
            )
        verdict = "; ".join(said) or "no step within twice the first step's TTFT"
        return (
            f"{self.rates.table()}\n\n{self.streams.table()}\n\nWithin {LATENCY_GROWTH:.0f}x the "
            f"first step's TTFT p50 and nothing failed: {verdict}."
        )

    def as_json(self) -> dict[str, object]:
        return {
            "placement": self.placement,
            "rates": [s.__dict__ for s in self.rates.steps],
            "streams": [s.__dict__ for s in self.streams.steps],
        }


def _paced(stack: Stack, workdir: Path, shape: CapacityShape) -> tuple[Child, str]:
    port = StackPorts.free().inference
    env = stack.service_env("inference") | {
        "LLM_MESH_INFERENCE_GRPC_PORT": str(port),
        "LLM_MESH_INFERENCE_METRICS_PORT": "0",
        "LLM_MESH_INFERENCE_MODELS": '["llm"]',
        "LLM_MESH_PACED_TTFT_MS": str(shape.ttft_ms),
        "LLM_MESH_PACED_ITL_MS": str(shape.itl_ms),
    }
    command = [sys.executable, "-m", "bench.paced_replica"]
    child = Child.spawn(f"paced-{port}", command, env, workdir / f"paced-{port}.log", workdir)
    address = f"127.0.0.1:{port}"
    child.wait_serving(address, time.monotonic() + 60)
    return child, address


@dataclass(frozen=True)
class CapacityFleet:
    router: str
    api_key: str
    meter: CpuMeter
    placement: str


@contextmanager
def capacity_fleet(workdir: Path, shape: CapacityShape) -> Iterator[CapacityFleet]:
    """The stack (policy, context, the tenants), paced replicas, and a router over them
    alone on the first CPU."""
    with Stack(workdir / "stack", StackPorts.free()) as stack:
        children: list[Child] = []
        try:
            addresses = []
            for _ in range(shape.replicas):
                child, address = _paced(stack, workdir, shape)
                children.append(child)
                addresses.append(address)
            endpoints = workdir / "paced.json"
            listed = [{"address": a, "version": "stable", "region": "local"} for a in addresses]
            endpoints.write_text(json.dumps({"endpoints": listed}))
            port = StackPorts.free().router
            wide = "100000"  # admission's window: never the bottleneck here
            router = stack.start_service(
                "router", port, workdir, endpoints_file=str(endpoints),
                admission__initial_limit=wide, admission__max_limit=wide,
            )  # fmt: skip
            children.append(router)
            router_pid = router.process.pid
            rest = [*stack.pids().values(), *(c.process.pid for c in children[:-1])]
            cpus = sorted(os.sched_getaffinity(0))
            if len(cpus) < 2:
                raise SystemExit("--scenario capacity needs at least two CPUs")
            pin([router_pid], set(cpus[:1]))
            pin([*rest, os.getpid()], set(cpus[1:]))
            placement = (
                f"the router alone on CPU {cpus[0]}; the paced replicas, the stack's services "
                f"and the load generator on CPUs {cpus[1:]}"
            )
            yield CapacityFleet(
                f"127.0.0.1:{port}", stack.api_key, CpuMeter({"router": [router_pid]}), placement
            )
        finally:
            for child in reversed(children):
                child.terminate(10)


async def _step(
    fleet: CapacityFleet, spec: WorkloadSpec, shape: LoadShape, label: str, offered: float
) -> Step:
    target = RouterTarget(fleet.router, "llm", fleet.api_key, timeout_s=60)
    try:
        before = fleet.meter.sample()
        measured = await run_load(target, make_requests(spec), shape, warmup=2, progress=False)
        spent = fleet.meter.sample().minus(before)
    finally:
        await target.close()
    summary = measured.summary(Slo())
    responses = sum(len(r.chunk_times) for r in measured.records if r.ok)
    return Step(
        label,
        offered,
        summary.requests_per_s,
        summary.output_tokens_per_s,
        responses / measured.duration_s if measured.duration_s else 0.0,
        summary.ttft_s["p50"] * 1000,
        summary.ttft_s["p99"] * 1000,
        summary.itl_s["p50"] * 1000,
        spent.seconds["router"] / spent.wall_s if spent.wall_s else 0.0,
        summary.failed,
    )


async def _rates(fleet: CapacityFleet, shape: CapacityShape) -> Sweep:
    steps = []
    for rate in shape.rates:
        spec = WorkloadSpec(
            num_prompts=max(int(rate * shape.rate_seconds), 20),
            input_len=shape.prompt_chars,
            output_len=shape.short_tokens,
            salt=new_salt(),
        )
        step = await _step(fleet, spec, LoadShape(rate=rate), f"{rate:.0f} req/s", rate)
        steps.append(step)
        print(step.row(steps[0].ttft_p50_ms), file=sys.stderr)
        if step.failed or step.ttft_p50_ms > 4 * LATENCY_GROWTH * steps[0].ttft_p50_ms:
            break  # far past the knee: the rest would only queue
    return Sweep("arrivals", steps)


async def _streams(fleet: CapacityFleet, shape: CapacityShape) -> Sweep:
    steps = []
    stream_s = shape.stream_tokens * shape.itl_ms / 1000
    for streams in shape.streams:
        per_stream = max(math.ceil(shape.stream_seconds / stream_s), 1)
        spec = WorkloadSpec(
            num_prompts=streams * per_stream,
            input_len=shape.prompt_chars,
            output_len=shape.stream_tokens,
            salt=new_salt(),
        )
        label = f"{streams} streams"
        step = await _step(fleet, spec, LoadShape(concurrency=streams), label, streams)
        steps.append(step)
        print(step.row(steps[0].ttft_p50_ms), file=sys.stderr)
        if step.failed or step.ttft_p50_ms > 4 * LATENCY_GROWTH * steps[0].ttft_p50_ms:
            break
    return Sweep("streams", steps)


def measure(workdir: Path, shape: CapacityShape) -> Capacity:
    with capacity_fleet(workdir, shape) as fleet:
        print(fleet.placement, file=sys.stderr)

        async def both() -> tuple[Sweep, Sweep]:
            return await _rates(fleet, shape), await _streams(fleet, shape)

        rates, streams = asyncio.run(both())
    return Capacity(shape, fleet.placement, rates, streams)

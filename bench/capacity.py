"""The router's capacity (``llm-mesh bench --scenario capacity``): the requests a second
one router process admits and picks, and the tokens a second it relays, on one CPU,
before its own latency doubles. The figure that says how many routers a fleet needs.

Nothing but the router may be the bottleneck. Upstream, paced replicas (bench/
paced_replica.py, the real inference service over a step clock) answer every request
after ``ttft_ms`` and give each running sequence a token every ``itl_ms``, however many
run. Downstream, the load comes from h2load (nghttp2's HTTP/2 load generator, in C:
Debian's nghttp2-client), sending the public gRPC API's Generate as a pre-encoded message;
a Python client could not keep up with the router it measures. The router runs alone on
the first CPU; the paced replicas, the stack's services, h2load and a probe share the
others. The tenant is the local stack's (the default rule set: the prompt is checked, and
the output as it streams), with no budgets, and admission control's window too wide to
queue: what is measured is the router's own work.

Each step runs for ``seconds``: h2load offers a rate of one-token requests (admitted and
picked: the per-request work), or holds a number of long generations open (relayed: the
per-token work), while a probe sends one-token requests one at a time and times them
(TTFT). A step's TTFT p50 is compared with the first step's; the capacity is the highest
step within twice it, with every request served.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from bench.cpu import CpuMeter, busy_seconds, reference_ms, split, stolen_seconds
from bench.metrics import RequestRecord
from bench.paced_replica import start_paced_replica
from bench.targets import RouterTarget
from bench.workload import BenchRequest, new_salt
from llmmesh.client import build_request
from llmmesh.launcher import Stack, StackPorts
from llmmesh.launcher.process import Child

LATENCY_GROWTH = 2.0  # "before its own latency doubles"
GENERATE_PATH = "/llmmesh.v1.Generation/Generate"
CLIENTS = 4  # h2load connections for the arrivals
PROBES_PER_S = 10  # the probe's rate: its requests are part of the load, a small one


@dataclass(frozen=True)
class CapacityShape:
    replicas: int = 2
    ttft_ms: float = 1.0
    itl_ms: float = 10.0
    rates: tuple[int, ...] = (40, 100, 200, 300, 400, 500, 600, 800)  # CLIENTS divide them
    streams: tuple[int, ...] = (16, 32, 64, 128, 192, 256)
    stream_tokens: int = 200
    seconds: float = 8.0
    prompt_chars: int = 128


@dataclass(frozen=True)
class Step:
    load: str  # "100 req/s" or "64 streams"
    served_per_s: float  # requests h2load saw served
    tokens_per_s: float  # relayed to h2load's clients
    latency_p50_ms: float  # of h2load's requests, to the end of each
    ttft_p50_ms: float  # the probe's
    ttft_p99_ms: float
    router_cpu: float  # the router's share of its CPU over the step
    others_cpu: float  # how busy the other CPUs were (the harness: is it the bottleneck?)
    failed: int  # h2load's failed streams, and the router's requests not served
    # The router's CPU's speed just before the step (bench/cpu.py reference_ms), and the
    # share of the step the hypervisor held that CPU: this machine's speed drifts.
    reference_ms: float = math.nan
    stolen: float = 0.0

    def row(self, base_ttft_ms: float) -> str:
        growth = self.ttft_p50_ms / base_ttft_ms if base_ttft_ms else math.inf
        return (
            f"| {self.load} | {self.served_per_s:.0f} | {self.tokens_per_s:,.0f} | "
            f"{self.latency_p50_ms:.1f} | {self.ttft_p50_ms:.1f} | {self.ttft_p99_ms:.1f} | "
            f"{growth:.2f}x | {self.router_cpu:.0%} | {self.others_cpu:.0%} | {self.failed} | "
            f"{self.reference_ms:.1f} | {self.stolen:.0%} |"
        )


@dataclass(frozen=True)
class Sweep:
    name: str
    steps: list[Step]

    def within(self) -> Step | None:
        """The highest step whose probe TTFT p50 is within LATENCY_GROWTH x the first's."""
        base = self.steps[0].ttft_p50_ms
        kept = [s for s in self.steps if not s.failed and s.ttft_p50_ms <= LATENCY_GROWTH * base]
        return kept[-1] if kept else None

    def table(self) -> str:
        base = self.steps[0].ttft_p50_ms
        head = (
            f"| {self.name} | requests/s | tokens/s | h2load latency p50 (ms) | probe TTFT p50 "
            "(ms) | probe TTFT p99 (ms) | TTFT p50 / first | router CPU | other CPUs | failed | "
            "reference task (ms) | stolen |\n"
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
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
                f"**{best_rate.served_per_s:.0f} requests/s** admitted and picked (probe TTFT "
                f"p50 {best_rate.ttft_p50_ms:.1f} ms, router CPU {best_rate.router_cpu:.0%})"
            )
        if best_streams is not None:
            said.append(
                f"**{best_streams.tokens_per_s:,.0f} tokens/s** relayed over "
                f"{best_streams.load} (probe TTFT p50 {best_streams.ttft_p50_ms:.1f} ms, "
                f"router CPU {best_streams.router_cpu:.0%})"
            )
        verdict = "; ".join(said) or "no step within twice the first step's TTFT"
        references = [s.reference_ms for s in (*self.rates.steps, *self.streams.steps)]
        return (
            f"{self.rates.table()}\n\n{self.streams.table()}\n\nWithin {LATENCY_GROWTH:.0f}x the "
            f"first step's probe TTFT p50 and every request served: {verdict}. The reference "
            f"task took {min(references):.1f} to {max(references):.1f} ms on the router's CPU "
            "before the steps (the same task in a run of another hour says whether its CPU "
            "was as fast)."
        )

    def as_json(self) -> dict[str, object]:
        return {
            "shape": asdict(self.shape),
            "placement": self.placement,
            "rates": [asdict(s) for s in self.rates.steps],
            "streams": [asdict(s) for s in self.streams.steps],
        }


def h2load_command() -> str:
    found = shutil.which("h2load")
    if found is None:
        raise SystemExit("--scenario capacity needs h2load (Debian's nghttp2-client)")
    return found


def grpc_message(prompt: str, max_tokens: int) -> bytes:
    """A Generate request as it goes on the wire: gRPC's 5-byte prefix, then the message."""
    payload = build_request(prompt, model="llm", max_tokens=max_tokens, ignore_eos=True)
    body = payload.SerializeToString()
    return b"\x00" + len(body).to_bytes(4, "big") + body


@dataclass(frozen=True)
class CapacityFleet:
    router: str
    metrics_url: str
    api_key: str
    meter: CpuMeter
    placement: str
    workdir: Path
    router_cpu: int
    others: list[int]  # the CPUs the router does not run on

    def served(self) -> dict[str, float]:
        """The router's requests so far, by outcome."""
        with urllib.request.urlopen(self.metrics_url, timeout=10) as reply:
            text = reply.read().decode()
        return {
            sample.labels["outcome"]: sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == "llm_router_requests_total"
        }


@contextmanager
def capacity_fleet(workdir: Path, shape: CapacityShape) -> Iterator[CapacityFleet]:
    """The stack (policy, context, the tenants), paced replicas, and a router over them
    alone on the first CPU."""
    with Stack(workdir / "stack", StackPorts.free()) as stack:
        children: list[Child] = []
        try:
            addresses = []
            for _ in range(shape.replicas):
                child, address = start_paced_replica(stack, workdir, shape.ttft_ms, shape.itl_ms)
                children.append(child)
                addresses.append(address)
            endpoints = workdir / "paced.json"
            listed = [{"address": a, "version": "stable", "region": "local"} for a in addresses]
            endpoints.write_text(json.dumps({"endpoints": listed}))
            ports = StackPorts.free()
            wide = "100000"  # admission's window: never the bottleneck here
            router = stack.start_service(
                "router", ports.router, workdir, endpoints_file=str(endpoints),
                admission__initial_limit=wide, admission__max_limit=wide,
                metrics_port=str(ports.router_metrics),
            )  # fmt: skip
            children.append(router)
            router_cpu = min(os.sched_getaffinity(0))  # _place gives the router the first
            yield CapacityFleet(
                f"127.0.0.1:{ports.router}",
                f"http://127.0.0.1:{ports.router_metrics}/metrics",
                stack.api_key,
                CpuMeter({"router": [router.process.pid]}),
                _place(router.process.pid, [*stack.pids().values(), *_pids(children[:-1])]),
                workdir,
                router_cpu,
                sorted(os.sched_getaffinity(0)),  # the bench's own, once placed
            )
        finally:
            for child in reversed(children):
                child.terminate(10)


def _pids(children: list[Child]) -> list[int]:
    return [child.process.pid for child in children]


def _place(router: int, rest: list[int]) -> str:
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise SystemExit("--scenario capacity needs at least two CPUs")
    split([router], set(cpus[:1]), rest, set(cpus[1:]))  # h2load, started from here, inherits
    return (
        f"the router alone on CPU {cpus[0]}; the paced replicas, the stack's services, "
        f"h2load and the probe on CPUs {cpus[1:]}"
    )


def _h2load(
    fleet: CapacityFleet, message: Path, log: Path, load: list[str], seconds: float
) -> None:
    command = [
        h2load_command(), *load, "-D", str(round(seconds)), "-d", str(message),
        "-H", "content-type: application/grpc", "-H", "te: trailers",
        "-H", f"authorization: Bearer {fleet.api_key}",
        "--log-file", str(log), f"http://{fleet.router}{GENERATE_PATH}",
    ]  # fmt: skip
    subprocess.run(command, check=True, capture_output=True, timeout=seconds + 120)


def read_h2load_log(log: Path) -> tuple[int, int, list[float]]:
    """(served, failed, latencies in s) from h2load's per-request log."""
    served, failed, latencies = 0, 0, []
    for line in log.read_text().splitlines():
        _, status, micros = line.split("\t")[:3]
        if status == "200":
            served += 1
            latencies.append(int(micros) / 1e6)
        else:
            failed += 1
    return served, failed, latencies


async def _probe(fleet: CapacityFleet, until: float) -> list[float]:
    """One-token requests, PROBES_PER_S of them a second, one at a time, until ``until``:
    their TTFT."""
    target = RouterTarget(fleet.router, "llm", fleet.api_key, timeout_s=60)
    ttft = []
    try:
        while (now := time.monotonic()) < until:
            record = RequestRecord(sent_at=time.perf_counter())
            await target.send(BenchRequest(new_salt() + "probe", 1), record)
            ttft.append(record.ttft)
            pause = now + 1 / PROBES_PER_S - time.monotonic()
            if pause > 0:
                await asyncio.sleep(pause)  # the probes' schedule, not synchronisation
    finally:
        await target.close()
    return ttft


def _step(fleet: CapacityFleet, label: str, load: list[str], tokens: int, seconds: float) -> Step:
    message = fleet.workdir / "request.bin"
    message.write_bytes(grpc_message(new_salt() + "x" * 120, tokens))
    log = fleet.workdir / "h2load.log"
    log.unlink(missing_ok=True)  # h2load appends to it
    reference = reference_ms(fleet.router_cpu)
    before, served_before = fleet.meter.sample(), fleet.served()
    others_before = busy_seconds(fleet.others)
    stolen_before = stolen_seconds([fleet.router_cpu])
    started = time.monotonic()

    async def probe_beside_h2load() -> list[float]:
        loading = asyncio.get_running_loop().run_in_executor(
            None, _h2load, fleet, message, log, load, seconds
        )
        probed = await _probe(fleet, started + seconds)
        await loading
        return probed

    ttft = asyncio.run(probe_beside_h2load())
    spent = fleet.meter.sample().minus(before)
    others = (busy_seconds(fleet.others) - others_before) / spent.wall_s / len(fleet.others)
    stolen = (stolen_seconds([fleet.router_cpu]) - stolen_before) / spent.wall_s
    outcomes = fleet.served()
    unserved = sum(  # h2load cuts what runs when its time is up: that is not a failure
        n - served_before.get(outcome, 0.0)
        for outcome, n in outcomes.items()
        if outcome not in ("length", "stop", "cancelled")
    )
    served, failed, latencies = read_h2load_log(log)
    ttft.sort()
    return Step(
        label,
        served / seconds,
        served * tokens / seconds,
        statistics.median(latencies) * 1000 if latencies else math.nan,
        statistics.median(ttft) * 1000,
        ttft[min(len(ttft) - 1, len(ttft) * 99 // 100)] * 1000,
        spent.seconds["router"] / spent.wall_s if spent.wall_s else 0.0,
        others,
        failed + int(unserved),
        reference,
        stolen,
    )


def _sweep(
    name: str, steps: list[tuple[str, list[str], int]], fleet: CapacityFleet, seconds: float
) -> Sweep:
    done: list[Step] = []
    for label, load, tokens in steps:
        step = _step(fleet, label, load, tokens, seconds)
        done.append(step)
        print(step.row(done[0].ttft_p50_ms), file=sys.stderr)
        if step.failed or step.ttft_p50_ms > 4 * LATENCY_GROWTH * done[0].ttft_p50_ms:
            break  # far past the knee: the rest would only queue
    return Sweep(name, done)


def measure(workdir: Path, shape: CapacityShape) -> Capacity:
    with capacity_fleet(workdir, shape) as fleet:
        print(fleet.placement, file=sys.stderr)
        rates = [
            (f"{rate} req/s", ["-c", str(CLIENTS), "-m", "64", "--rps", str(rate // CLIENTS)], 1)
            for rate in shape.rates
        ]
        streams = [
            (f"{n} streams", ["-c", str(n), "-m", "1"], shape.stream_tokens) for n in shape.streams
        ]
        by_rate = _sweep("arrivals", rates, fleet, shape.seconds)
        by_streams = _sweep("streams", streams, fleet, shape.seconds)
    return Capacity(shape, fleet.placement, by_rate, by_streams)

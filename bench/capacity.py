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

Each step runs again at once against a bare grpc.aio server on the router's CPU (bench/
bare_streamer.py: the same Generate method streaming the same paced tokens, nothing
else): what the transport itself does there in the same minutes, the ceiling under the
router's figure on a machine whose speed drifts.
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
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from bench.bare_streamer import start_bare_streamer
from bench.cpu import CpuMeter, busy_seconds, pin, reference_ms, split, stolen_seconds
from bench.metrics import RequestRecord
from bench.paced_replica import start_paced_replica
from bench.targets import RouterStreamTarget, RouterTarget
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
    # CLIENTS divide them; the sweeps stop past the knee
    rates: tuple[int, ...] = (40, 100, 200, 300, 400, 500, 600, 800, 1200, 1600)
    # 75 tokens/s a stream with the gap of 40 ms: 267 streams are the goal's 20,000
    # (20,025), measured as a step of its own rather than read between 256 and 288
    streams: tuple[int, ...] = (16, 32, 64, 128, 192, 256, 267, 288, 384)
    stream_tokens: int = 200
    # The stream gap the upstreams keep after a stream's first responses (the inference
    # service's engine_stream_gap_ms, which the reference engine honours); 0: a response
    # per token, as an engine that is not asked streams.
    stream_gap_ms: float = 0.0
    seconds: float = 8.0
    prompt_chars: int = 128
    # The streams' generations held on one GenerateStream call (bench/stream_load.py), and
    # the probe's on one too, instead of a Generate call each (h2load's, the probe's).
    on_a_stream: bool = False


@dataclass(frozen=True)
class Step:
    load: str  # "100 req/s" or "64 streams"
    served_per_s: float  # requests h2load saw served
    tokens_per_s: float  # relayed to h2load's clients
    latency_p50_ms: float  # of h2load's requests, to the end of each
    ttft_p50_ms: float  # the probe's
    ttft_p99_ms: float
    server_cpu: float  # the measured server's share of its CPU over the step
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
            f"{growth:.2f}x | {self.server_cpu:.0%} | {self.others_cpu:.0%} | {self.failed} | "
            f"{self.reference_ms:.1f} | {self.stolen:.0%} |"
        )


@dataclass(frozen=True)
class Sweep:
    name: str
    steps: list[Step]
    server: str = "router"  # whose CPU the table's CPU column is

    def within(self) -> Step | None:
        """The highest step whose probe TTFT p50 is within LATENCY_GROWTH x the first's."""
        base = self.steps[0].ttft_p50_ms
        kept = [s for s in self.steps if not s.failed and s.ttft_p50_ms <= LATENCY_GROWTH * base]
        return kept[-1] if kept else None

    def table(self) -> str:
        base = self.steps[0].ttft_p50_ms
        head = (
            f"| {self.name} | requests/s | tokens/s | h2load latency p50 (ms) | probe TTFT p50 "
            f"(ms) | probe TTFT p99 (ms) | TTFT p50 / first | {self.server} CPU | other CPUs | "
            "failed | reference task (ms) | stolen |\n"
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
        )
        return "\n".join([head, *(s.row(base) for s in self.steps)])

    def verdict(self, what: str) -> str:
        """The highest rate, or tokens/s, within LATENCY_GROWTH x the first's TTFT."""
        best = self.within()
        if best is None:
            return f"no step of the {self.name} within {LATENCY_GROWTH:.0f}x the first's TTFT"
        figure = (
            f"**{best.served_per_s:.0f} requests/s** {what}"
            if self.name == "arrivals"
            else f"**{best.tokens_per_s:,.0f} tokens/s** {what} over {best.load}"
        )
        return (
            f"{figure} (probe TTFT p50 {best.ttft_p50_ms:.1f} ms, {self.server} CPU "
            f"{best.server_cpu:.0%})"
        )


@dataclass(frozen=True)
class Capacity:
    shape: CapacityShape
    placement: str
    rates: Sweep
    streams: Sweep
    # The same steps against the bare streamer on the router's CPU: gRPC's own ceiling.
    bare_rates: Sweep
    bare_streams: Sweep

    def report(self) -> str:
        verdict = f"{self.rates.verdict('admitted and picked')}; {self.streams.verdict('relayed')}"
        sweeps = [self.rates, self.streams, self.bare_rates, self.bare_streams]
        references = [step.reference_ms for sweep in sweeps for step in sweep.steps]
        return (
            f"{self.rates.table()}\n\n{self.streams.table()}\n\nWithin {LATENCY_GROWTH:.0f}x "
            f"the first step's probe TTFT p50 and every request served: {verdict}.\n\n"
            "Each step was run at once against a bare grpc.aio server on the router's CPU as "
            "well (bench/bare_streamer.py: the public Generate method streaming the same "
            "paced tokens, its clock included, and nothing else), the transport's own "
            f"ceiling:\n\n{self.bare_rates.table()}\n\n{self.bare_streams.table()}\n\n"
            f"Within {LATENCY_GROWTH:.0f}x, the bare server: "
            f"{self.bare_rates.verdict('answered')}; {self.bare_streams.verdict('streamed')}. "
            f"The reference task took {min(references):.1f} to {max(references):.1f} "
            "ms on the router's CPU before the steps (the same task in a run of another hour "
            "says whether its CPU was as fast)."
        )

    def as_json(self) -> dict[str, object]:
        return {
            "shape": asdict(self.shape),
            "placement": self.placement,
            "rates": [asdict(s) for s in self.rates.steps],
            "streams": [asdict(s) for s in self.streams.steps],
            "bare_rates": [asdict(s) for s in self.bare_rates.steps],
            "bare_streams": [asdict(s) for s in self.bare_streams.steps],
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
    server: str  # what h2load and the probe call: the router, or the bare streamer
    metrics_url: str | None  # the router's; the bare streamer keeps no count
    api_key: str
    meter: CpuMeter  # the server's process, as "server"
    placement: str
    workdir: Path
    server_cpu: int  # the first CPU, the measured server's alone
    others: list[int]  # the CPUs the measured server does not run on

    def served(self) -> dict[str, float]:
        """The router's requests so far, by outcome."""
        if self.metrics_url is None:
            return {}
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
                child, address = start_paced_replica(
                    stack, workdir, shape.ttft_ms, shape.itl_ms, shape.stream_gap_ms
                )
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
            first_cpu = min(os.sched_getaffinity(0))  # _place gives the router the first
            yield CapacityFleet(
                f"127.0.0.1:{ports.router}",
                f"http://127.0.0.1:{ports.router_metrics}/metrics",
                stack.api_key,
                CpuMeter({"server": [router.process.pid]}),
                _place(router.process.pid, [*stack.pids().values(), *_pids(children[:-1])]),
                workdir,
                first_cpu,
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
        "--log-file", str(log), f"http://{fleet.server}{GENERATE_PATH}",
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


def _stream_load(
    fleet: CapacityFleet, prompt: str, options: list[str], tokens: int, seconds: float
) -> tuple[int, int, list[float]]:
    """(served, failed, latencies in s) of generations held on one GenerateStream call by
    bench/stream_load.py, in a process of its own (as h2load is)."""
    out = fleet.workdir / "stream_load.json"
    command = [
        sys.executable, "-m", "bench.stream_load", "--server", fleet.server,
        "--key", fleet.api_key, "--tokens", str(tokens), "--seconds", str(seconds),
        "--prompt", prompt, "--out", str(out), *options,
    ]  # fmt: skip
    subprocess.run(command, check=True, capture_output=True, timeout=seconds + 120)
    held = json.loads(out.read_text())
    return held["served"], held["failed"], held["latencies_s"]


async def _probe(fleet: CapacityFleet, until: float, on_a_stream: bool) -> list[float]:
    """One-token requests, PROBES_PER_S of them a second, one at a time, until ``until``:
    their TTFT (each a Generate call, or a generation on one GenerateStream call)."""
    target = (
        RouterStreamTarget(fleet.server, "llm", fleet.api_key)
        if on_a_stream
        else RouterTarget(fleet.server, "llm", fleet.api_key, timeout_s=60)
    )
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


def _step(fleet: CapacityFleet, step: LoadStep, seconds: float) -> Step:
    label, load, tokens = step.label, step.options, step.tokens
    prompt = new_salt() + "x" * 120
    message = fleet.workdir / "request.bin"
    message.write_bytes(grpc_message(prompt, tokens))
    log = fleet.workdir / "h2load.log"
    log.unlink(missing_ok=True)  # h2load appends to it
    reference = reference_ms(fleet.server_cpu)
    before, served_before = fleet.meter.sample(), fleet.served()
    others_before = busy_seconds(fleet.others)
    stolen_before = stolen_seconds([fleet.server_cpu])
    started = time.monotonic()

    def run_load() -> tuple[int, int, list[float]]:
        if step.on_a_stream:
            return _stream_load(fleet, prompt, load, tokens, seconds)
        _h2load(fleet, message, log, load, seconds)
        return read_h2load_log(log)

    async def probe_beside_load() -> tuple[list[float], tuple[int, int, list[float]]]:
        loading = asyncio.get_running_loop().run_in_executor(None, run_load)
        probed = await _probe(fleet, started + seconds, step.on_a_stream)
        return probed, await loading

    ttft, (served, failed, latencies) = asyncio.run(probe_beside_load())
    spent = fleet.meter.sample().minus(before)
    others = (busy_seconds(fleet.others) - others_before) / spent.wall_s / len(fleet.others)
    stolen = (stolen_seconds([fleet.server_cpu]) - stolen_before) / spent.wall_s
    outcomes = fleet.served()
    unserved = sum(  # h2load cuts what runs when its time is up: that is not a failure
        n - served_before.get(outcome, 0.0)
        for outcome, n in outcomes.items()
        if outcome not in ("length", "stop", "cancelled")
    )
    ttft.sort()
    return Step(
        label,
        served / seconds,
        served * tokens / seconds,
        statistics.median(latencies) * 1000 if latencies else math.nan,
        statistics.median(ttft) * 1000,
        ttft[min(len(ttft) - 1, len(ttft) * 99 // 100)] * 1000,
        spent.seconds["server"] / spent.wall_s if spent.wall_s else 0.0,
        others,
        failed + int(unserved),
        reference,
        stolen,
    )


def _past_the_knee(done: list[Step]) -> bool:
    """The last step failed or took far past twice the first's TTFT: the rest would only
    queue."""
    return bool(done) and (
        done[-1].failed > 0 or done[-1].ttft_p50_ms > 4 * LATENCY_GROWTH * done[0].ttft_p50_ms
    )


def _sweeps(
    name: str, steps: Load, router: CapacityFleet, bare: CapacityFleet, seconds: float
) -> tuple[Sweep, Sweep]:
    """Each step against the router, then at once against the bare streamer: this machine's
    speed drifts within minutes, so the pair of figures of a step is of one speed."""
    routed: list[Step] = []
    streamed: list[Step] = []
    for step in steps:
        for done, fleet in ((routed, router), (streamed, bare)):
            if not _past_the_knee(done):
                done.append(_step(fleet, step, seconds))
                server = "router" if fleet is router else "bare"
                print(f"{server:6} {done[-1].row(done[0].ttft_p50_ms)}", file=sys.stderr)
        if _past_the_knee(routed) and _past_the_knee(streamed):
            break
    return Sweep(name, routed), Sweep(name, streamed, "server")


@contextmanager
def bare_beside_router(fleet: CapacityFleet, shape: CapacityShape) -> Iterator[CapacityFleet]:
    """The bare streamer on the router's CPU, as a fleet whose measured server it is (each
    idles while the other is measured)."""
    child, address = start_bare_streamer(
        fleet.workdir, shape.ttft_ms, shape.itl_ms, shape.stream_gap_ms
    )
    try:
        pin([child.process.pid], {fleet.server_cpu})
        meter = CpuMeter({"server": [child.process.pid]})
        yield replace(fleet, server=address, metrics_url=None, meter=meter)
    finally:
        child.terminate(10)


@dataclass(frozen=True)
class LoadStep:
    label: str
    options: list[str]  # h2load's, or bench/stream_load.py's
    tokens: int  # each request's
    on_a_stream: bool = False  # generations held on one GenerateStream call, not h2load


Load = list[LoadStep]


def _arrivals(rates: Iterable[int]) -> Load:
    h2load_clients = ["-c", str(CLIENTS), "-m", "64"]
    return [
        LoadStep(f"{rate} req/s", [*h2load_clients, "--rps", str(rate // CLIENTS)], 1)
        for rate in rates
    ]


def _streams(counts: Iterable[int], tokens: int, on_a_stream: bool) -> Load:
    if on_a_stream:
        return [
            LoadStep(f"{n} on a stream", ["--generations", str(n)], tokens, on_a_stream=True)
            for n in counts
        ]
    return [LoadStep(f"{n} streams", ["-c", str(n), "-m", "1"], tokens) for n in counts]


def measure(workdir: Path, shape: CapacityShape) -> Capacity:
    with capacity_fleet(workdir, shape) as router, bare_beside_router(router, shape) as bare:
        print(router.placement, file=sys.stderr)
        rates = _arrivals(shape.rates)
        by_rate, bare_rates = _sweeps("arrivals", rates, router, bare, shape.seconds)
        streams = _streams(shape.streams, shape.stream_tokens, shape.on_a_stream)
        by_streams, bare_streams = _sweeps("streams", streams, router, bare, shape.seconds)
    return Capacity(shape, router.placement, by_rate, by_streams, bare_rates, bare_streams)

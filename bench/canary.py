"""What the canary analysis costs and how fast it acts (``llm-mesh bench --scenario canary``).

- **Mirroring's cost to clients**: two routers over the same stable replica (the tiny
  model on Triton), alternating rounds of the same closed-loop load: one mirrors 10% of
  stable's requests to the canary, one does not. The canary is a paced replica
  (bench/paced_replica.py: the real inference service over a clock), standing for a canary
  on hardware of its own: on this 2-core machine a second engine would take the stable
  engine's CPU, and the figure would be the machine's, not the mirror's. What is left is
  the mesh's own work for a shadow (the copy, the canary's stream, scoring both answers)
  and the top-k log probabilities the stable engine computes for a mirrored request.
- **A bad canary's rollback**: the stack's canary (the tiny model with another seed's
  weights, so it answers otherwise) rolled out under an open-loop load with the default
  gates (50 mirrored pairs before a drift verdict), the mirror at 10%: seconds from the
  first step to weight 0, and the share of client requests the canary served before.
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc

from bench.paced_replica import start_paced_replica
from bench.report import Run
from bench.targets import RouterTarget, named
from llmmesh.canary import FileRouting
from llmmesh.client import authorized_channel, build_request
from llmmesh.launcher import Stack, StackPorts
from llmmesh.launcher.process import Child
from llmmesh.rollout import FileStatus, Rollout, RolloutDocument, RouterObservations
from llmmesh.v1 import generation_pb2_grpc

NO_MIRROR, MIRROR = "no mirror", "mirror 10%"
ROLLBACK_RATE = 8.0  # client requests a second while the bad canary rolls out
ROLLBACK_INTERVAL_S = 5.0  # between the rollout's judgements
BASE_ROUTING = "split: {stable: 100, canary: 0}\ncolors: {canary: canary}\n"
MIRROR_ROUTING = BASE_ROUTING + "mirror: {subset: canary, percent: 10, max_in_flight: 4}\n"


def _endpoints(path: Path, stable: str, canary: str) -> Path:
    pairs = (("stable", stable), ("canary", canary))
    endpoints = [{"address": a, "version": v, "region": "local"} for v, a in pairs]
    path.write_text(json.dumps({"endpoints": endpoints}))
    return path


@dataclass(frozen=True)
class MirrorFleet:
    without: str
    mirrored: str
    api_key: str

    def targets(self) -> list[RouterTarget]:
        """Clients of both routers (made inside the event loop that uses them)."""
        return [
            named(RouterTarget(self.without, "llm", self.api_key), NO_MIRROR),
            named(RouterTarget(self.mirrored, "llm", self.api_key), MIRROR),
        ]


@contextmanager
def mirror_fleet(workdir: Path, ttft_ms: float = 20, itl_ms: float = 5) -> Iterator[MirrorFleet]:
    with Stack(workdir / "stack", StackPorts.free()) as stack:
        canary, canary_address = start_paced_replica(stack, workdir, ttft_ms, itl_ms)
        children: list[Child] = [canary]
        try:
            endpoints = _endpoints(
                workdir / "endpoints.json", stack.address("inference"), canary_address
            )
            addresses = []
            for name, routing in (("plain", BASE_ROUTING), ("mirrored", MIRROR_ROUTING)):
                (workdir / f"{name}.yaml").write_text(routing)
                port = StackPorts.free().router
                router = stack.start_service(
                    "router",
                    port,
                    workdir,
                    routing_file=str(workdir / f"{name}.yaml"),
                    endpoints_file=str(endpoints),
                )
                children.append(router)
                addresses.append(f"127.0.0.1:{port}")
            yield MirrorFleet(addresses[0], addresses[1], stack.api_key)
        finally:
            for child in reversed(children):  # routers first: they hold the canary's streams
                child.terminate(10)


def mirror_table(runs: list[Run]) -> str:
    lines = [
        "| load | TTFT p50 (ms) no mirror / mirror | TTFT p99 (ms) no mirror / mirror | "
        "output tok/s no mirror / mirror | TTFT p50 | TTFT p99 | tok/s |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    by_load: dict[str, dict[str, Run]] = {}
    for run in runs:
        by_load.setdefault(run.load, {})[run.target] = run
    for load, pair in by_load.items():
        base, cand = pair[NO_MIRROR].summary, pair[MIRROR].summary
        p50 = (base.ttft_s["p50"] * 1000, cand.ttft_s["p50"] * 1000)
        p99 = (base.ttft_s["p99"] * 1000, cand.ttft_s["p99"] * 1000)
        rate = (base.output_tokens_per_s, cand.output_tokens_per_s)
        lines.append(
            f"| {load} | {p50[0]:.1f} / {p50[1]:.1f} | {p99[0]:.1f} / {p99[1]:.1f} | "
            f"{rate[0]:.0f} / {rate[1]:.0f} | {_worse(*p50)} | {_worse(*p99)} | "
            f"{_worse(rate[1], rate[0])} |"
        )
    return "\n".join(lines)


def _worse(base: float, candidate: float) -> str:
    """How much worse the candidate is, in percent (negative: better)."""
    return f"{100 * (candidate / base - 1):+.1f}%" if base else "n/a"


@dataclass(frozen=True)
class Rollback:
    outcome: str
    seconds_to_zero: float | None
    step: int
    pairs: int
    canary_requests: int
    requests: int
    rate: float

    def table(self) -> str:
        when = "-" if self.seconds_to_zero is None else f"{self.seconds_to_zero:.1f}"
        share = 100 * self.canary_requests / self.requests if self.requests else 0.0
        return (
            "| outcome | seconds to weight 0 | at step | mirrored pairs by then | "
            "client requests before | served by the canary |\n"
            "| --- | --- | --- | --- | --- | --- |\n"
            f"| {self.outcome} | {when} | {self.step} | {self.pairs} | {self.requests} | "
            f"{self.canary_requests} ({share:.2f}%) |"
        )


class PoissonLoad:
    """Requests arriving at ``rate`` a second, each on its own thread, until stopped;
    records when each was answered and by which subset."""

    def __init__(self, address: str, key: str, rate: float, max_tokens: int = 16) -> None:
        self._address, self._key, self._rate = address, key, rate
        self._max_tokens = max_tokens
        self._stop = threading.Event()
        self.answers: list[tuple[float, str]] = []  # (time answered, subset)
        self._thread = threading.Thread(target=self._arrivals, daemon=True)

    def __enter__(self) -> PoissonLoad:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(60)

    def _arrivals(self) -> None:
        rng = random.Random(0)
        workers: list[threading.Thread] = []
        with authorized_channel(self._address, self._key) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            n = 0
            while not self._stop.wait(rng.expovariate(self._rate)):  # the arrival process
                n += 1
                worker = threading.Thread(target=self._ask, args=(stub, n), daemon=True)
                worker.start()
                workers.append(worker)
            for worker in workers:
                worker.join(60)

    def _ask(self, stub: generation_pb2_grpc.GenerationStub, n: int) -> None:
        request = build_request(f"tell me about {n}", max_tokens=self._max_tokens)
        try:
            last = list(stub.Generate(request, timeout=60))[-1]
        except grpc.RpcError:
            return
        self.answers.append((time.time(), last.served.subset))


def rollback(workdir: Path, rate: float, interval_s: float) -> Rollback:
    """The stack's canary (another seed's weights) rolled out with the default gates."""
    with Stack(workdir / "stack", StackPorts.free()) as stack:
        routing = workdir / "routing.yaml"
        routing.write_text(MIRROR_ROUTING)
        endpoints = _endpoints(
            workdir / "endpoints.json",
            stack.address("inference"),
            stack.address("inference_canary"),
        )
        ports = StackPorts.free()
        router = stack.start_service(
            "router", ports.router, workdir,
            routing_file=str(routing), endpoints_file=str(endpoints),
            http_port=str(ports.router_http), watch_interval_s="0.2",
        )  # fmt: skip
        try:
            document = RolloutDocument(model="llm", interval=interval_s, max_wait=1000)
            url = f"http://127.0.0.1:{ports.router_http}/internal/canary"
            status = FileStatus(workdir / "status.json")
            run = Rollout(
                document.settings(),
                FileRouting(routing),
                RouterObservations([url], stack.internal_token),
                status,
            )
            with PoissonLoad(f"127.0.0.1:{ports.router}", stack.api_key, rate) as load:
                started = time.time()
                outcome = run.run()
                drift = RouterObservations([url], stack.internal_token).since(started)
            written = status.read() or {}
        finally:
            router.terminate(10)
    pairs = drift["models"].get("llm", {}).get("drift", {}).get("canary", {}).get("pairs", 0)
    zero = next((h for h in written.get("history", []) if h["state"] == "rolled_back"), None)
    ended = zero["time"] if zero else time.time()
    before = [subset for at, subset in load.answers if at <= ended]
    return Rollback(
        outcome.value,
        zero["time"] - started if zero else None,
        int(zero["step"]) if zero else 0,
        int(pairs),
        before.count("canary"),
        len(before),
        rate,
    )

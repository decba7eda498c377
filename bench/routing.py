"""Routing benchmark: the LLM-aware picker against round-robin, over the same replicas.

A fleet of four reference-engine replicas (one Triton, four copies of the model, each its
own engine process) behind two routers, one per algorithm. The workload is multi-turn
sessions whose first turn starts with a preamble shared by a group of sessions; later
turns carry the conversation so far (the router prepends it from the session store).
Sessions arrive as a Poisson process; each session's turns follow one another. Both
routers get the same sessions (freshly salted, so neither inherits the other's cache),
in alternating order over the rounds.

Also measured: the picker's decision time with 64 endpoints, prefix hashing included.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import re
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from bench.cpu import cpu_budgets, model_processes
from bench.loadgen import Measurement, send_one
from bench.metrics import PERCENTILES, RequestRecord, Slo, Summary, percentile
from bench.targets import RouterTarget, Target, write_tenants
from bench.workload import BenchRequest, new_salt, text_of_length
from llmmesh.launcher import Stack, StackPorts
from llmmesh.launcher.process import Child
from llmmesh.launcher.redis import start_redis
from llmmesh.launcher.routers import RouterFleetPorts, start_front, write_front_config
from llmmesh.launcher.sidecars import wait_ready
from llmmesh.launcher.stack import REPO_MODELS
from services.router.affinity import prefix_hashes
from services.router.endpoints import Endpoint
from services.router.routing import RoutingPolicy
from services.router.scheduling import Candidate, PickRequest, Scheduler, SchedulingState
from services.router.scheduling.filters import split_point

ALGORITHMS = ("llm_aware", "round_robin")
REPLICAS = 4


@dataclass(frozen=True)
class SessionSpec:
    """Chat sessions: a system preamble shared by a group of sessions, a short opening
    of the session's own, then questions and answers; the history grows every turn."""

    sessions: int = 32
    turns: int = 6
    prefix_groups: int = 4
    shared_prefix_len: int = 512  # the preamble every session of a group starts with
    context_len: int = 128  # then the session's own opening
    question_len: int = 96
    output_len: int = 96
    seed: int = 0


def make_sessions(spec: SessionSpec, salt: str) -> list[list[BenchRequest]]:
    """Each session's turns; the first carries the group preamble and the session's
    own material, later ones a question each (the router prepends the history)."""
    rng = random.Random(spec.seed)
    preambles = [
        salt + text_of_length(rng, spec.shared_prefix_len) + "\n" for _ in range(spec.prefix_groups)
    ]
    sessions = []
    for n in range(spec.sessions):
        session_id = f"bench-{salt.strip('[] ')}-{n}"
        opening = preambles[n % len(preambles)] + text_of_length(rng, spec.context_len) + "\n"
        turns = [
            BenchRequest(
                (opening if turn == 0 else "") + text_of_length(rng, spec.question_len),
                spec.output_len,
                session_id,
            )
            for turn in range(spec.turns)
        ]
        sessions.append(turns)
    return sessions


async def run_sessions(
    target: Target,
    sessions: list[list[BenchRequest]],
    rate: float,
    seed: int,
    stateless: bool = False,
) -> Measurement:
    """Sessions arrive at ``rate`` per second; a session's turns run back to back. With
    ``stateless``, the client keeps the history: each turn sends the session's earlier
    prompts before its own, with no session id (what a router that keeps no sessions, such
    as vllm-router, needs to see a conversation's prefix); the answers are left out of it,
    so that every target gets the very same prompts whatever the model wrote."""
    rng = random.Random(seed)
    records: list[RequestRecord] = []

    async def converse(turns: list[BenchRequest]) -> None:
        history = ""
        for turn in turns:
            history += turn.prompt
            sent = replace(turn, prompt=history, session_id="") if stateless else turn
            records.append(await send_one(target, sent, None))

    started = time.perf_counter()
    tasks, next_at = [], started
    for turns in sessions:
        delay = next_at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)  # arrival schedule, not synchronisation
        tasks.append(asyncio.create_task(converse(turns)))
        next_at += rng.expovariate(rate)
    await asyncio.gather(*tasks)
    return Measurement(records, time.perf_counter() - started)


# -- the fleet ---------------------------------------------------------------------------


def replica_model(n: int) -> str:
    return f"llm_r{n}"


def replica_models() -> list[str]:
    return [replica_model(n) for n in range(REPLICAS)]


def build_repository(root: Path) -> Path:
    """The stack's models plus ``REPLICAS`` copies of llm, each its own engine."""
    repo = root / "models"
    repo.mkdir(parents=True)
    for model in ("llm", "llm_canary"):
        (repo / model).symlink_to(REPO_MODELS / model, target_is_directory=True)
    config = (REPO_MODELS / "llm" / "config.pbtxt").read_text()
    for n in range(REPLICAS):
        model_dir = repo / replica_model(n)
        model_dir.mkdir()
        (model_dir / "1").symlink_to(REPO_MODELS / "llm" / "1", target_is_directory=True)
        renamed = re.sub(r'^name: "llm"', f'name: "{replica_model(n)}"', config, flags=re.M)
        (model_dir / "config.pbtxt").write_text(renamed)
    return repo


def start_replicas(stack: Stack, workdir: Path, children: list[Child]) -> list[str]:
    """``REPLICAS`` inference services, each over its own copy of the model; their
    addresses."""
    replicas = []
    for n in range(REPLICAS):
        port = StackPorts.free().inference
        aliases = json.dumps({"llm": replica_model(n)})
        children.append(stack.start_service("inference", port, workdir, model_aliases=aliases))
        replicas.append(f"127.0.0.1:{port}")
    return replicas


def router_settings(
    workdir: Path,
    name: str,
    replicas: list[str],
    algorithm: str,
    tenants: Path,
    *,
    engine_cpu: float | None = None,
) -> dict[str, str]:
    """A router's settings: its own endpoints file over ``replicas``, its picker. Without
    ``engine_cpu`` (``replica_fleet``'s) the engines share this host's CPUs, and the
    endpoints say so: one device, which runs as many engines at once as it has CPUs (each
    engine computes on one thread)."""
    shared = {"device": "bench-host"} if engine_cpu is None else {}
    endpoints = workdir / f"endpoints-{name}.json"
    endpoints.write_text(json.dumps({"endpoints": [{"address": a, **shared} for a in replicas]}))
    routing = workdir / f"routing-{name}.json"
    packing = {"packing": {"engines_at_once": len(os.sched_getaffinity(0))}} if shared else {}
    routing.write_text(json.dumps({"algorithm": algorithm, **packing}))
    return {
        "endpoints_file": str(endpoints),
        "routing_file": str(routing),
        "tenants_file": str(tenants),
    }


@contextlib.contextmanager
def replica_fleet(
    workdir: Path, engine_cpu: float | None = None
) -> Iterator[tuple[Stack, list[str], Path, str, list[Child]]]:
    """The stack over the fleet's repository and its ``REPLICAS`` replicas; yields the
    stack, the replicas' addresses, the tenants file, the API key of the sessions' tenant
    and the list of children to stop with the fleet (routers added by the caller). The
    tenant is a ``critical`` one, which admission queues rather than sheds: a refused turn
    has no TTFT, so refusals would leave the slowest turns out of the percentiles.
    ``engine_cpu``: each replica's engine held to that share of a CPU of its own
    (``cpu_budgets``), as on accelerators of their own; none: engines share every CPU."""
    # Triton loads only the models it is told to (explicit model control): the replicas'
    # copies too, or a replica's first requests would find its model not served.
    stack = Stack(
        workdir / "stack",
        StackPorts.free(),
        model_repository=build_repository(workdir),
        models=("llm", *replica_models()),
    )
    tenants = workdir / "bench-tenants.json"
    api_key = write_tenants(tenants, ["critical"])["critical"]
    children: list[Child] = []
    with stack, contextlib.ExitStack() as budgets:
        if engine_cpu is not None:
            engines = model_processes(stack.pids()["triton"], replica_models())
            budgets.enter_context(cpu_budgets(engines, engine_cpu))
        try:
            replicas = start_replicas(stack, workdir, children)
            yield stack, replicas, tenants, api_key, children
        finally:
            for child in reversed(children):
                child.terminate(10)


@contextlib.contextmanager
def routing_fleet(
    workdir: Path, routers: int = 1, engine_cpu: float | None = None
) -> Iterator[tuple[dict[str, str], str, str]]:
    """Starts the fleet; yields router address by algorithm, the API key of the
    sessions' tenant and Triton's metrics URL. The routers run as deployed, admission
    control included. With ``routers`` > 1, each algorithm has that many routers sharing
    their state through a Redis, behind an Envoy front, whose address is the one yielded.
    ``engine_cpu``: as ``replica_fleet``'s."""
    with replica_fleet(workdir, engine_cpu) as (stack, replicas, tenants, api_key, children):
        redis_url = ""
        if routers > 1:
            port = StackPorts.free().redis
            children.append(start_redis(workdir / "redis", port))
            redis_url = f"redis://127.0.0.1:{port}/0"
        fronts = {}
        for algorithm in ALGORITHMS:
            settings = router_settings(
                workdir, algorithm, replicas, algorithm, tenants, engine_cpu=engine_cpu
            )
            if routers > 1:
                settings |= {
                    "state": "redis",
                    "redis_url": redis_url,
                    "shared__key_prefix": f"bench-{algorithm}/",
                }
            fleet = RouterFleetPorts.free(routers)
            for ports in fleet.replicas:
                http = {"http_port": str(ports.http)} if routers > 1 else {}
                children.append(
                    stack.start_service("router", ports.grpc, workdir, **settings, **http)
                )
            if routers == 1:
                fronts[algorithm] = f"127.0.0.1:{fleet.replicas[0].grpc}"
                continue
            front_ports = StackPorts.free()
            config = write_front_config(
                workdir / algorithm, fleet, front_ports.router, front_ports.router_http,
                "127.0.0.1",
            )  # fmt: skip
            front = start_front(config, workdir / f"front-{algorithm}.log", workdir)
            children.append(front)
            wait_ready(front, fleet.front_admin, time.monotonic() + 60)
            fronts[algorithm] = f"127.0.0.1:{front_ports.router}"
        yield fronts, api_key, triton_metrics_url(stack)


def triton_metrics_url(stack: Stack) -> str:
    return f"http://{stack.address('triton_metrics')}/metrics"


# -- the comparison ----------------------------------------------------------------------


ENGINE_COUNTERS = {
    "llm_engine_requests_finished_total": "finished",
    "llm_engine_prompt_tokens_total": "prompt",
    "llm_engine_prefix_cache_hit_tokens_total": "cached",
}


@dataclass(frozen=True)
class Placement:
    """Where a picker's requests went: the generations each replica's engine finished,
    and the prompt tokens its prefix cache held, over all replicas (Triton's metrics)."""

    finished: tuple[float, ...]
    prompt_tokens: float
    cached_tokens: float

    def minus(self, before: Placement) -> Placement:
        return Placement(
            tuple(a - b for a, b in zip(self.finished, before.finished, strict=True)),
            self.prompt_tokens - before.prompt_tokens,
            self.cached_tokens - before.cached_tokens,
        )

    def plus(self, other: Placement) -> Placement:
        return Placement(
            tuple(a + b for a, b in zip(self.finished, other.finished, strict=True)),
            self.prompt_tokens + other.prompt_tokens,
            self.cached_tokens + other.cached_tokens,
        )

    def cells(self) -> str:
        shares = " / ".join(f"{n:.0f}" for n in self.finished)
        cached = self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
        return f"{shares} | {cached:.0%}"


def read_placement(metrics_url: str) -> Placement:
    """The fleet's engine counters now, from Triton's metrics."""
    with urllib.request.urlopen(metrics_url, timeout=10) as reply:
        return placement_of(reply.read().decode())


def placement_of(text: str) -> Placement:
    """The engine counters of each replica model (``llm_r<n>``) in Triton's metrics."""
    totals: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            kind = ENGINE_COUNTERS.get(sample.name)
            if kind is not None:
                key = (kind, sample.labels.get("model", ""))
                totals[key] = totals.get(key, 0.0) + sample.value
    models = [replica_model(n) for n in range(REPLICAS)]
    return Placement(
        tuple(totals.get(("finished", m), 0.0) for m in models),
        sum(totals.get(("prompt", m), 0.0) for m in models),
        sum(totals.get(("cached", m), 0.0) for m in models),
    )


@dataclass
class RoutingResult:
    """Per arrival rate (sessions/s), each picker's summary; and the picker's own cost."""

    summaries: dict[float, dict[str, Summary]]
    picker_s: dict[str, float]  # decision time percentiles, 64 endpoints
    baseline: str = "round_robin"  # the picker llm_aware is compared with
    placements: dict[float, dict[str, Placement]] = field(default_factory=dict)

    def _placement(self, rate: float, name: str) -> str:
        placed = self.placements.get(rate, {}).get(name)
        return placed.cells() if placed is not None else "– | –"

    def table(self) -> str:
        rows = [
            "| sessions/s | picker | turns | failed | TTFT p50 (ms) | TTFT p90 (ms) "
            "| TTFT p99 (ms) | TPOT p50 (ms) | output tokens/s | generations per replica "
            "| prompt tokens cached |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        ratios = [
            f"| sessions/s | {self.baseline} / llm_aware TTFT p99 | llm_aware / "
            f"{self.baseline} output tokens/s |",
            "| --- | --- | --- |",
        ]
        for rate, by_picker in self.summaries.items():
            for name, s in by_picker.items():
                t = s.ttft_s
                rows.append(
                    f"| {rate} | {name} | {s.requests} | {s.failed} | {t['p50'] * 1e3:.0f} "
                    f"| {t['p90'] * 1e3:.0f} | {t['p99'] * 1e3:.0f} "
                    f"| {s.tpot_s['p50'] * 1e3:.1f} | {s.output_tokens_per_s:.1f} "
                    f"| {self._placement(rate, name)} |"
                )
            aware, other = by_picker["llm_aware"], by_picker[self.baseline]
            ratios.append(
                f"| {rate} | {other.ttft_s['p99'] / aware.ttft_s['p99']:.2f}x "
                f"| {aware.output_tokens_per_s / other.output_tokens_per_s:.2f}x |"
            )
        p = self.picker_s
        return (
            "\n".join(rows)
            + "\n\n"
            + "\n".join(ratios)
            + "\n\nPicker decision with 64 endpoints (prefix hashing included): "
            f"p50 {p['p50'] * 1e6:.0f} µs, p99 {p['p99'] * 1e6:.0f} µs"
        )


Compared = tuple[dict[float, dict[str, Summary]], dict[float, dict[str, Placement]]]


async def compare_pickers(
    targets: dict[str, Target],
    spec: SessionSpec,
    rates: list[float],
    rounds: int,
    metrics_url: str,
    *,
    stateless: bool = False,
) -> Compared:
    """Each rate, ``rounds`` times per target, alternating which target goes first; per
    rate and target, the summary and where the engines ran the requests
    (``metrics_url``: Triton's metrics)."""
    names = list(targets)
    pooled: dict[tuple[float, str], Measurement] = {}
    placed: dict[tuple[float, str], Placement] = {}
    try:
        for target in targets.values():  # warm-up: connections, code paths
            warm = make_sessions(replace(spec, sessions=REPLICAS, turns=1), new_salt())
            await run_sessions(target, warm, rate=100.0, seed=0, stateless=stateless)
        for rate in rates:
            for n in range(rounds):
                for name in names if n % 2 == 0 else reversed(names):
                    sessions = make_sessions(replace(spec, seed=spec.seed + n), new_salt())
                    before = read_placement(metrics_url)
                    measured = await run_sessions(targets[name], sessions, rate, n, stateless)
                    where = read_placement(metrics_url).minus(before)
                    key = (rate, name)
                    if key in pooled:
                        pooled[key].add(measured)
                        placed[key] = placed[key].plus(where)
                    else:
                        pooled[key], placed[key] = measured, where
    finally:
        for target in targets.values():
            await target.close()
    summaries = {r: {n: pooled[(r, n)].summary(Slo()) for n in names} for r in rates}
    return summaries, {r: {n: placed[(r, n)] for n in names} for r in rates}


def router_targets(routers: dict[str, str], api_key: str) -> dict[str, Target]:
    """The gRPC target of each picker's router (sessions kept by the router)."""
    return {name: RouterTarget(address, "llm", api_key) for name, address in routers.items()}


def picker_decision_time(
    endpoints: int = 64, decisions: int = 20_000, seed: int = 0
) -> dict[str, float]:
    """Percentiles of one decision (prefix hashing + pick) among ``endpoints`` replicas."""
    rng = random.Random(seed)
    candidates = [
        Candidate(
            Endpoint(
                address=f"10.0.{n // 250}.{n % 250}:50061",
                version="canary" if n % 8 == 0 else "stable",
                region="eu" if n % 2 else "us",
            ),
            "eu" if n % 2 else "us",
            in_flight=rng.randrange(8),
            load={
                "running": rng.randrange(32),
                "waiting": rng.randrange(4),
                "kv_utilization": rng.random(),
            },
        )
        for n in range(endpoints)
    ]
    policy = RoutingPolicy(split={"stable": 90, "canary": 10}, regions=["eu", "us"])
    picker = Scheduler(SchedulingState("eu", rng=rng))
    preambles = [text_of_length(rng, 1024) for _ in range(16)]
    times = []
    for n in range(decisions):
        prompt = preambles[n % 16] + text_of_length(rng, 512)
        session = f"t/s{rng.randrange(2000)}"
        started = time.perf_counter()
        request = PickRequest(
            "llm",
            prefix_hashes(prompt),
            prompt_chars=len(prompt),
            session_key=session,
            split_point=split_point(session, rng),
        )
        picker.pick(request, candidates, policy)
        times.append(time.perf_counter() - started)
    return {f"p{q}": percentile(times, q) for q in PERCENTILES}

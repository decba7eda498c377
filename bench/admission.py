"""Admission benchmark: three tenants in three tiers at twice the fleet's capacity, through
three routers in one run: without admission control (FIFO: every request goes straight to
the engine, without a priority), with it but without engine priority (adaptive window,
tier shares of it, queue priority, shedding), and with it and engine priority (the tier
reaches the engine, which preempts a lower tier's generation for a higher one; no tier
share of the window, only the higher tiers' expected slots left free).

Capacity is measured first (closed loop, many streams, through the FIFO router); the
offered load is then Poisson at twice that, in two mixes: a third of the requests per
tier, and critical at one sixth (the common case). The floor of each mix is its critical
requests alone, at their rate in the mix, through the FIFO router. A request counts
towards goodput when it succeeded within its tier's TTFT target and the TPOT target.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import random
import statistics
import time
import urllib.request
from collections.abc import Awaitable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from prometheus_client.parser import text_string_to_metric_families

from bench.loadgen import send_one
from bench.metrics import RequestRecord, percentile
from bench.routing import triton_metrics_url
from bench.targets import NO_ADMISSION_CONTROL, RouterTarget, write_tenants
from bench.workload import BenchRequest, new_salt, text_of_length
from llmmesh.launcher import Stack, StackPorts
from llmmesh.launcher.process import Child

T = TypeVar("T")

TIERS = ("critical", "standard", "sheddable")
TTFT_TARGET_S = {"critical": 0.5, "standard": 1.0, "sheddable": 2.0}
TPOT_TARGET_S = 0.1
CAPACITY_ROUNDS = 3  # the capacity's measurements; the load is twice their median
# The unloaded p99's requests: the goal's denominator; of 20, a p99 is nearly their maximum.
UNLOADED_REQUESTS = 100
ROUTERS = ("fifo", "admission", "engine priority")
# Router settings beside the tenants (FIFO also has NO_ADMISSION_CONTROL).
ROUTER_SETTINGS = {
    "fifo": {"admission__engine_priority": "false"},
    "admission": {"admission__engine_priority": "false"},
    "engine priority": {"admission__engine_priority": "true"},
}
# Each mix: the tiers of successive requests, in turn.
MIXES = {
    "a third each": TIERS,
    "critical one sixth": (
        "critical",
        "standard",
        "standard",
        "sheddable",
        "sheddable",
        "sheddable",
    ),
}


@dataclass(frozen=True)
class Shape:
    """Every request's size (tokens)."""

    prompt_len: int = 128
    output_len: int = 64


@dataclass(frozen=True)
class TierRecord:
    tier: str
    record: RequestRecord

    def good(self) -> bool:
        r = self.record
        tpot = r.tpot
        return (
            r.ok and r.ttft <= TTFT_TARGET_S[self.tier] and (tpot is None or tpot <= TPOT_TARGET_S)
        )


@dataclass
class RunResult:
    router: str
    rate: float
    duration_s: float
    records: list[TierRecord] = field(default_factory=list)
    started: float = 0.0
    engine: EngineWork | None = None  # what the run made the engine do (None: not read)

    def of(self, tier: str) -> list[TierRecord]:
        return [r for r in self.records if r.tier == tier]

    def goodput(self, tier: str | None = None) -> float:
        records = self.of(tier) if tier else self.records
        return sum(r.good() for r in records) / self.duration_s

    def good_share(self, tier: str) -> float:
        records = self.of(tier)
        return sum(r.good() for r in records) / len(records) if records else 0.0

    def good_shares_by_arrival(self, tier: str, parts: int = 10) -> list[float]:
        """The good share of each ``parts``-th of the tier's requests in arrival order: a
        stretch this machine ran slow, or a queue that never drained, as the p99 cannot
        tell them apart."""
        records = self.of(tier)
        cuts = [len(records) * i // parts for i in range(parts + 1)]
        chunks = [records[a:b] for a, b in itertools.pairwise(cuts) if b > a]
        return [sum(r.good() for r in chunk) / len(chunk) for chunk in chunks]

    def ttft_p99(self, tier: str) -> float:
        return percentile([r.record.ttft for r in self.of(tier) if r.record.ok], 99)

    def late_answers(self, timeout_s: float) -> int:
        """Requests answered (success or error) more than a second after their deadline."""
        return sum(1 for r in self.records if r.record.e2e > timeout_s + 1)


@dataclass(frozen=True)
class Fleet:
    routers: dict[str, str]  # name -> address
    keys: dict[str, str]  # tier -> API key of that tier's tenant
    unloaded_p99_s: float  # critical TTFT p99 with nothing else running
    engine_metrics: str = ""  # Triton's /metrics (the engine's counters); "": not read


@dataclass(frozen=True)
class EngineWork:
    """The engine's counters (Triton's /metrics, summed over its models): time in steps, the
    part of it in steps that left work out for a first word, and tokens. Subtracted, what
    one run made the engine do."""

    steps_s: float = 0.0
    first_word_s: float = 0.0
    generated: float = 0.0
    recomputed: float = 0.0
    steps: float = 0.0
    wall_s: float = 0.0  # a run's: the time between the two readings

    def since(self, before: EngineWork, wall_s: float) -> EngineWork:
        return EngineWork(
            self.steps_s - before.steps_s,
            self.first_word_s - before.first_word_s,
            self.generated - before.generated,
            self.recomputed - before.recomputed,
            self.steps - before.steps,
            wall_s,
        )

    @property
    def busy_share(self) -> float:
        return self.steps_s / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def tokens_per_busy_s(self) -> float:
        """Generated tokens per second of steps: with every request the same size, the
        engine's throughput while it works, whatever its scheduling costs it."""
        return self.generated / self.steps_s if self.steps_s > 0 else 0.0

    @property
    def tokens_per_step(self) -> float:
        """The sequences a step samples, on average: how full the engine's batch ran (this
        engine's throughput grows with it)."""
        return self.generated / self.steps if self.steps > 0 else 0.0

    @property
    def first_word_share(self) -> float:
        return self.first_word_s / self.steps_s if self.steps_s > 0 else 0.0


ENGINE_WORK = {
    "llm_engine_step_seconds_total": "steps_s",
    "llm_engine_first_word_step_seconds_total": "first_word_s",
    "llm_engine_generation_tokens_total": "generated",
    "llm_engine_recomputed_tokens_total": "recomputed",
    "llm_engine_steps_total": "steps",
}


def engine_work_of(text: str) -> EngineWork:
    """EngineWork of Triton's metrics text, summed over its models."""
    totals = dict.fromkeys(ENGINE_WORK.values(), 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in ENGINE_WORK:
                totals[ENGINE_WORK[sample.name]] += sample.value
    return EngineWork(**totals)


def read_engine_work(metrics_url: str) -> EngineWork:
    with urllib.request.urlopen(metrics_url, timeout=10) as reply:
        return engine_work_of(reply.read().decode())


async def _unloaded(stack: Stack, shape: Shape) -> float:
    target = RouterTarget(stack.address("router"), "llm", stack.api_key)
    try:
        return await unloaded_ttft_p99(target, shape)
    finally:
        await target.close()


@contextlib.contextmanager
def admission_fleet(workdir: Path, shape: Shape) -> Iterator[Fleet]:
    """The local stack plus two routers (FIFO, admission) with one tenant per tier, and
    the critical tier's unloaded TTFT p99, measured first through the stack's router.

    The admission router keeps its tier targets (TTFT_TARGET_S): a critical target of
    twice the unloaded p99 (about 40 ms here, one engine step) shrinks the window below
    what the critical traffic alone needs, and everything queues (measured: critical
    p99 3 s, goodput no better than FIFO)."""
    tenants = workdir / "bench-tenants.json"
    keys = write_tenants(tenants, TIERS)
    with Stack(workdir / "stack", StackPorts.free()) as stack:
        unloaded = asyncio.run(_unloaded(stack, shape))
        children: list[Child] = []
        try:
            routers = {}
            for name in ROUTERS:
                port = StackPorts.free().router
                settings = {
                    "tenants_file": str(tenants),
                    "admission__ttft_target_s": json.dumps(TTFT_TARGET_S),
                    **ROUTER_SETTINGS[name],
                    **(NO_ADMISSION_CONTROL if name == "fifo" else {}),
                }
                children.append(stack.start_service("router", port, workdir, **settings))
                routers[name] = f"127.0.0.1:{port}"
            yield Fleet(routers, keys, unloaded, triton_metrics_url(stack))
        finally:
            for child in children:
                child.terminate(10)


def requests(n: int, seed: int, shape: Shape) -> list[BenchRequest]:
    rng = random.Random(seed)
    salt = new_salt()
    return [
        BenchRequest(salt + text_of_length(rng, shape.prompt_len), shape.output_len)
        for _ in range(n)
    ]


async def capacity_rounds(target: RouterTarget, shape: Shape) -> list[float]:
    """The fleet's capacity measured CAPACITY_ROUNDS times in a row: this machine's speed
    changes within seconds, and one round of a few seconds may catch a fast or a slow
    stretch; the load is set from their median."""
    return [await capacity_rps(target, shape, seed) for seed in range(1, CAPACITY_ROUNDS + 1)]


async def capacity_rps(target: RouterTarget, shape: Shape, seed: int = 1) -> float:
    """Requests per second the fleet completes with plenty of streams in flight."""
    work = requests(96, seed, shape)
    started = time.perf_counter()
    pending = list(work)

    async def worker() -> None:
        while pending:
            await send_one(target, pending.pop(), None)

    await asyncio.gather(*(worker() for _ in range(32)))
    return len(work) / (time.perf_counter() - started)


async def unloaded_ttft_p99(target: RouterTarget, shape: Shape) -> float:
    """Critical TTFT p99 one request at a time, over UNLOADED_REQUESTS requests."""
    work = requests(UNLOADED_REQUESTS, 2, shape)
    records = [await send_one(target, r, None) for r in work]
    return percentile([r.ttft for r in records if r.ok], 99)


async def open_loop(
    router: str,
    targets: dict[str, RouterTarget],
    rate: float,
    duration_s: float,
    shape: Shape,
    *,
    tiers: tuple[str, ...] = TIERS,
) -> RunResult:
    """Poisson arrivals at ``rate``, ``tiers`` in turn, for ``duration_s``."""
    rng = random.Random(3)
    work = requests(int(rate * duration_s), 4, shape)
    result = RunResult(router, rate, duration_s, started=time.perf_counter())
    tasks = []
    next_at = result.started
    for n, request in enumerate(work):
        delay = next_at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)  # arrival schedule, not synchronisation
        tier = tiers[n % len(tiers)]
        tasks.append((tier, asyncio.create_task(send_one(targets[tier], request, None))))
        next_at += rng.expovariate(rate)
    for tier, task in tasks:
        result.records.append(TierRecord(tier, await task))
    result.duration_s = time.perf_counter() - result.started
    return result


async def _measured(metrics_url: str, run: Awaitable[T]) -> tuple[T, EngineWork | None]:
    """``run``'s result, and what it made the engine do."""
    if not metrics_url:
        return await run, None
    before = await asyncio.to_thread(read_engine_work, metrics_url)
    started = time.monotonic()
    result = await run
    wall_s = time.monotonic() - started
    after = await asyncio.to_thread(read_engine_work, metrics_url)
    return result, after.since(before, wall_s)


async def _measured_run(metrics_url: str, run: Awaitable[RunResult]) -> RunResult:
    result, engine = await _measured(metrics_url, run)
    result.engine = engine
    return result


def plot(runs: list[MixRuns], path: Path, window_s: float = 5.0) -> None:
    """TTFT p50 and p99 per tier over time: a row per mix, a panel per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = max(len(m.all()) for m in runs)
    fig, grid = plt.subplots(
        len(runs), columns, figsize=(5 * columns, 4 * len(runs)), sharey=True, squeeze=False
    )
    for row, mix in zip(grid, runs, strict=True):
        for ax, result in zip(row, mix.all(), strict=False):
            _panel(ax, result, window_s)
            ax.set_title(f"{mix.name}: {result.router}", fontsize="medium")
        row[0].set_ylabel("TTFT (s)")
    grid[0][-1].legend(fontsize="small")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _panel(ax: Any, result: RunResult, window_s: float) -> None:
    for tier, color in zip(TIERS, ("tab:red", "tab:blue", "tab:gray"), strict=True):
        points: dict[int, list[float]] = {}
        for r in result.of(tier):
            if r.record.ok:
                window = int((r.record.sent_at - result.started) // window_s)
                points.setdefault(window, []).append(r.record.ttft)
        xs = sorted(points)
        for q, style in ((50, "-"), (99, ":")):
            ys = [percentile(points[x], q) for x in xs]
            ax.plot([x * window_s for x in xs], ys, style, color=color, label=f"{tier} p{q}")
    ax.set_xlabel("time since start (s)")
    ax.set_yscale("log")


@dataclass
class MixRuns:
    """One mix: each router's run, and the floor (its critical requests alone)."""

    name: str
    runs: dict[str, RunResult]
    critical_alone: RunResult

    def all(self) -> list[RunResult]:
        return [*self.runs.values(), self.critical_alone]


def _rows(mix: MixRuns) -> list[str]:
    rows = []
    for result in mix.all():
        for tier in TIERS:
            recs = result.of(tier)
            if not recs:
                continue
            ok = [r.record.ttft for r in recs if r.record.ok]
            rows.append(
                f"| {mix.name} | {result.router} | {tier} | {len(recs)} | {len(recs) - len(ok)} "
                f"| {percentile(ok, 50) * 1e3:.0f} | {percentile(ok, 99) * 1e3:.0f} "
                f"| {result.good_share(tier):.0%} | {result.goodput(tier):.2f} |"
            )
    return rows


def _summary(
    mix: MixRuns,
    unloaded_p99: float,
    timeout_s: float,
    capacity: float,
    capacity_engine: EngineWork | None = None,
) -> list[str]:
    fifo, plain, priority = (mix.runs[name] for name in ROUTERS)
    alone = mix.critical_alone
    crit, floor = priority.ttft_p99("critical"), alone.ttft_p99("critical")
    share, floor_share = priority.good_share("critical"), alone.good_share("critical")
    late = {name: run.late_answers(timeout_s) for name, run in mix.runs.items()}
    return [
        f"**{mix.name}** ({priority.rate:.2f} req/s offered):",
        f"- critical TTFT p99 with engine priority {crit * 1e3:.0f} ms = {crit / floor:.2f}x "
        f"the floor's {floor * 1e3:.0f} ms (goal <= 1.1x), {crit / unloaded_p99:.2f}x unloaded; "
        f"good share {share:.0%} against the floor's {floor_share:.0%} (goal: at most 2 "
        "points below)",
        f"- overall goodput: engine priority {priority.goodput():.2f} req/s, admission "
        f"without it {plain.goodput():.2f} ({_ratio(priority, plain):.2f}x, goal >= 1.2x), "
        f"FIFO {fifo.goodput():.2f} ({_ratio(priority, fifo):.1f}x, goal >= 10x); of the "
        f"capacity, engine priority {priority.goodput() / capacity:.0%} and admission without "
        f"it {plain.goodput() / capacity:.0%}, so 1.2x admission's is "
        f"{1.2 * plain.goodput() / capacity:.0%} of it",
        "- critical good share by tenths of arrival: "
        + "; ".join(f"{run.router} {_tenths(run)}" for run in mix.all()),
        f"- answered after their deadline ({timeout_s:.0f} s): "
        + ", ".join(f"{name} {n}" for name, n in late.items())
        + " (goal 0)",
        *_engine_work(mix, capacity_engine),
    ]


def _tenths(run: RunResult) -> str:
    return " ".join(f"{share:.0%}" for share in run.good_shares_by_arrival("critical"))


def _engine_work(mix: MixRuns, capacity: EngineWork | None) -> list[str]:
    """What each router's run made the engine do: whether it was kept busy, and how much it
    generated per second of steps (what its scheduling costs the batch)."""
    if any(run.engine is None for run in mix.runs.values()):
        return []
    works = {name: run.engine for name, run in mix.runs.items() if run.engine is not None}
    reference = (
        f", {capacity.tokens_per_busy_s:,.0f} and {capacity.tokens_per_step:.1f} in the "
        "capacity run"
        if capacity is not None
        else ""
    )
    each = "; ".join(
        f"{name} {w.busy_share:.0%}, {w.tokens_per_busy_s:,.0f}, {w.tokens_per_step:.1f}"
        for name, w in works.items()
    )
    priority, plain = works["engine priority"], works["admission"]
    efficiency = priority.tokens_per_busy_s / max(plain.tokens_per_busy_s, 1e-9)
    return [
        f"- the engine in each run, busy share, generated tokens per busy second and per "
        f"step{reference}: "
        f"{each}; engine priority {efficiency:.2f}x admission's per busy second, "
        f"{priority.recomputed:,.0f} tokens recomputed after preemptions, "
        f"{priority.first_word_share:.0%} of its step time in steps that left lower tiers out "
        "for a first word"
    ]


def _rounds(rounds: list[float]) -> str:
    if len(rounds) < 2:
        return ""
    return f", the median of {len(rounds)} rounds ({', '.join(f'{r:.2f}' for r in rounds)})"


def _ratio(better: RunResult, worse: RunResult) -> float:
    return better.goodput() / max(worse.goodput(), 1e-9)


def table(comparison: AdmissionComparison) -> str:
    rows = [
        "| mix | run | tier | requests | failed | TTFT p50 (ms) | TTFT p99 (ms) "
        "| good share | goodput (req/s) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    summary = [
        f"Capacity (closed loop, 32 streams): {comparison.capacity_rps:.2f} req/s"
        f"{_rounds(comparison.capacity_rounds)}; offered twice that. Critical TTFT p99 "
        f"unloaded: {comparison.unloaded_p99_s * 1e3:.0f} ms.",
    ]
    for mix in comparison.mixes:
        rows += _rows(mix)
        summary += [
            "",
            *_summary(
                mix,
                comparison.unloaded_p99_s,
                comparison.timeout_s,
                comparison.capacity_rps,
                comparison.capacity_engine,
            ),
        ]
    sixth = comparison.mixes[-1].runs["engine priority"]
    crit = sixth.ttft_p99("critical")
    summary.append(
        f"- {comparison.mixes[-1].name}: critical TTFT p99 {crit / comparison.unloaded_p99_s:.2f}x "
        f"unloaded (goal <= 2x), good share {sixth.good_share('critical'):.0%} (goal >= 95%)"
    )
    return "\n".join(rows) + "\n\n" + "\n".join(summary)


@dataclass
class AdmissionComparison:
    capacity_rps: float
    unloaded_p99_s: float
    mixes: list[MixRuns]
    timeout_s: float
    capacity_rounds: list[float] = field(default_factory=list)  # capacity_rps: their median
    capacity_engine: EngineWork | None = None  # what the capacity rounds made the engine do

    def table(self) -> str:
        return table(self)

    def as_json(self) -> dict[str, Any]:
        """Every request of every run, for a look at what the table sums up."""
        return {
            "capacity_rps": self.capacity_rps,
            "capacity_rounds": self.capacity_rounds,
            "capacity_engine": asdict(self.capacity_engine) if self.capacity_engine else None,
            "unloaded_p99_s": self.unloaded_p99_s,
            "timeout_s": self.timeout_s,
            "mixes": [
                {"name": mix.name, "runs": [_run_json(run) for run in mix.all()]}
                for mix in self.mixes
            ],
        }


def _run_json(run: RunResult) -> dict[str, Any]:
    return {
        "router": run.router,
        "rate": run.rate,
        "duration_s": run.duration_s,
        "engine": asdict(run.engine) if run.engine is not None else None,
        "requests": [
            {
                "tier": r.tier,
                "good": r.good(),
                "error": r.record.error,
                "ttft_s": r.record.ttft if r.record.ok else None,
                "tpot_s": r.record.tpot if r.record.ok else None,
                "e2e_s": r.record.e2e,
                "output_tokens": r.record.output_tokens,
            }
            for r in run.records
        ],
    }


async def compare(
    fleet: Fleet, duration_s: float, shape: Shape, timeout_s: float = 30.0
) -> AdmissionComparison:
    """Capacity, then per mix every router at twice capacity, and the floor."""
    targets = {
        name: {tier: RouterTarget(address, "llm", fleet.keys[tier], timeout_s) for tier in TIERS}
        for name, address in fleet.routers.items()
    }
    try:
        rounds, capacity_engine = await _measured(
            fleet.engine_metrics, capacity_rounds(targets["fifo"]["standard"], shape)
        )
        capacity = statistics.median(rounds)
        mixes = []
        for name, tiers in MIXES.items():
            runs = {
                router: await _measured_run(
                    fleet.engine_metrics,
                    open_loop(
                        router, targets[router], 2 * capacity, duration_s, shape, tiers=tiers
                    ),
                )
                for router in ROUTERS
            }
            critical_rate = 2 * capacity * tiers.count("critical") / len(tiers)
            alone = await open_loop(
                "critical alone", targets["fifo"], critical_rate, duration_s, shape,
                tiers=("critical",),
            )  # fmt: skip
            mixes.append(MixRuns(name, runs, alone))
    finally:
        for by_tier in targets.values():
            for target in by_tier.values():
                await target.close()
    return AdmissionComparison(
        capacity, fleet.unloaded_p99_s, mixes, timeout_s, rounds, capacity_engine
    )

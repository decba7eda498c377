"""Benchmark results as JSON and as a Markdown section of docs/benchmarks.md."""

from __future__ import annotations

import json
import platform
import re
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.cpu import CpuSpent
from bench.metrics import RequestRecord, Summary


@dataclass(frozen=True)
class Run:
    target: str
    load: str
    concurrency: int | None
    summary: Summary
    records: list[RequestRecord] = field(default_factory=list)  # for the plots
    cpu: CpuSpent | None = None  # each process group's CPU beyond its idle rate
    # Router plus inference CPU per request (ms) in each round, for the spread of a ratio.
    cpu_rounds: list[float] = field(default_factory=list)
    idle: CpuSpent | None = None  # each process group's CPU with no request in flight
    # The same per round, idle rate included: all the CPU the two spent while it ran.
    cpu_rounds_with_idle: list[float] = field(default_factory=list)

    @property
    def responses(self) -> int:
        """Responses with text the client received."""
        return sum(len(r.chunk_times) for r in self.records if r.ok)


def write_json(path: Path, command: str, config: dict[str, Any], runs: list[Run]) -> None:
    doc = {
        "command": command,
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"cpus": _cpus(), "python": platform.python_version()},
        "config": config,
        "runs": [
            {
                "target": r.target,
                "load": r.load,
                "summary": r.summary.as_dict(),
                "router_inference_cpu_ms_per_round": r.cpu_rounds,
            }
            for r in runs
        ],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2) + "\n")


def _cpus() -> int:
    import os

    return len(os.sched_getaffinity(0))


def _ms(value: float) -> str:
    return f"{value * 1000:.1f}"


def results_table(runs: list[Run]) -> str:
    lines = [
        "| load | target | TTFT p50 / p90 / p99 (ms) | TPOT p50 (ms) | ITL p50 (ms) "
        "| E2E p50 (ms) | output tok/s | req/s | goodput req/s | failed |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for run in runs:
        s = run.summary
        ttft = " / ".join(_ms(s.ttft_s[p]) for p in ("p50", "p90", "p99"))
        lines.append(
            f"| {run.load} | {run.target} | {ttft} | {_ms(s.tpot_s['p50'])} "
            f"| {_ms(s.itl_s['p50'])} | {_ms(s.e2e_s['p50'])} | {s.output_tokens_per_s:.0f} "
            f"| {s.requests_per_s:.2f} | {s.goodput_per_s:.2f} | {s.failed} |"
        )
    return "\n".join(lines)


def comparison_table(runs: list[Run], baseline: str, candidate: str) -> str:
    """Per load: candidate's added TTFT p50 and its throughput relative to the baseline."""
    lines = [
        f"| load | added TTFT p50 ({candidate} - {baseline}, ms) "
        f"| output tok/s ratio ({candidate} / {baseline}) |",
        "| --- | --- | --- |",
    ]
    by_load: dict[str, dict[str, Summary]] = {}
    for run in runs:
        by_load.setdefault(run.load, {})[run.target] = run.summary
    for load, targets in by_load.items():
        if baseline in targets and candidate in targets:
            base, cand = targets[baseline], targets[candidate]
            added = (cand.ttft_s["p50"] - base.ttft_s["p50"]) * 1000
            base_rate = base.output_tokens_per_s
            ratio = f"{cand.output_tokens_per_s / base_rate:.3f}" if base_rate else "n/a"
            lines.append(f"| {load} | {added:+.2f} | {ratio} |")
    return "\n".join(lines)


# The mesh's own processes: what a request costs beyond the engine's work.
MESH_GROUPS = ("router", "inference", "policy", "context")


def cpu_table(runs: list[Run]) -> str:
    """Per load and target: each process group's CPU per request (beyond its idle rate),
    and the mesh's per request and per relayed response."""
    measured = [r for r in runs if r.cpu is not None]
    if not measured:
        return ""
    groups = sorted({g for r in measured if r.cpu for g in r.cpu.seconds}, key=_group_order)
    lines = [
        "| load | target | requests | responses | "
        + " | ".join(f"{g} ms/req" for g in groups)
        + " | mesh ms/req | mesh µs/response |",
        "| --- | --- | --- | --- | " + " | ".join("---" for _ in groups) + " | --- | --- |",
    ]
    for run in measured:
        assert run.cpu is not None
        done = max(run.summary.requests - run.summary.failed, 1)
        per_request = [run.cpu.seconds.get(g, 0.0) * 1000 / done for g in groups]
        mesh = sum(run.cpu.seconds.get(g, 0.0) for g in MESH_GROUPS)
        per_response = mesh * 1e6 / max(run.responses, 1)
        lines.append(
            f"| {run.load} | {run.target} | {done} | {run.responses} | "
            + " | ".join(f"{v:.2f}" for v in per_request)
            + f" | {mesh * 1000 / done:.2f} | {per_response:.0f} |"
        )
    return "\n".join(lines)


def idle_table(runs: list[Run]) -> str:
    """Per target: each process group's CPU with no request in flight, as a share of a
    CPU (what a stack costs its host while it waits)."""
    idle = {r.target: r.idle for r in runs if r.idle is not None and r.idle.wall_s > 0}
    if not idle:
        return ""
    groups = sorted({g for spent in idle.values() for g in spent.seconds}, key=_group_order)
    lines = [
        "| target | " + " | ".join(groups) + " | mesh |",
        "| --- | " + " | ".join("---" for _ in groups) + " | --- |",
    ]
    for target, spent in idle.items():
        shares = [spent.seconds.get(g, 0.0) / spent.wall_s for g in groups]
        mesh = sum(spent.seconds.get(g, 0.0) for g in MESH_GROUPS) / spent.wall_s
        lines.append(f"| {target} | " + " | ".join(f"{v:.1%}" for v in shares) + f" | {mesh:.1%} |")
    return "\n".join(lines)


# The services a request crosses on its way to the engine: the CPU the cost goal counts.
PATH_GROUPS = ("router", "inference")


def path_cpu_ms(cpu: CpuSpent, requests: int) -> float:
    """Router plus inference CPU per request, in ms."""
    return sum(cpu.seconds.get(g, 0.0) for g in PATH_GROUPS) * 1000 / max(requests, 1)


def cpu_ratio_table(runs: list[Run], baseline: str, candidate: str) -> str:
    """Per load: the candidate's router plus inference CPU per request over the baseline's,
    pooled and round by round (the rounds alternate, so each pair ran minutes apart); then
    the same with each one's idle rate left in: code that idles more cheaply has less of
    its CPU subtracted, so the first ratio alone would count that against it."""
    by_load: dict[str, dict[str, Run]] = {}
    for run in runs:
        by_load.setdefault(run.load, {})[run.target] = run
    lines = [
        f"| load | router plus inference CPU per request ({candidate} / {baseline}) "
        "| per round: median (lowest - highest) | idle rate included | per round |",
        "| --- | --- | --- | --- | --- |",
    ]
    for load, targets in by_load.items():
        base, cand = targets.get(baseline), targets.get(candidate)
        if base is None or cand is None or base.cpu is None or cand.cpu is None:
            continue
        pooled = path_cpu_ms(cand.cpu, _done(cand)) / max(path_cpu_ms(base.cpu, _done(base)), 1e-9)
        with_idle = _with_idle_ms(cand) / max(_with_idle_ms(base), 1e-9)
        lines.append(
            f"| {load} | {pooled:.2f}x | {_spread(cand.cpu_rounds, base.cpu_rounds)} "
            f"| {with_idle:.2f}x "
            f"| {_spread(cand.cpu_rounds_with_idle, base.cpu_rounds_with_idle)} |"
        )
    return "\n".join(lines) if len(lines) > 2 else ""


def _with_idle_ms(run: Run) -> float:
    """Router plus inference CPU per request over the whole run, idle rate included."""
    assert run.cpu is not None
    idle = run.idle
    rate = {g: idle.seconds.get(g, 0.0) / idle.wall_s for g in PATH_GROUPS} if idle else {}
    spent = sum(
        run.cpu.seconds.get(g, 0.0) + rate.get(g, 0.0) * run.cpu.wall_s for g in PATH_GROUPS
    )
    return spent * 1000 / max(_done(run), 1)


def _spread(candidate: list[float], baseline: list[float]) -> str:
    rounds = sorted(c / b for c, b in zip(candidate, baseline, strict=False) if b > 0)
    if not rounds:
        return "n/a"
    return (
        f"{statistics.median(rounds):.2f}x ({rounds[0]:.2f}x - {rounds[-1]:.2f}x, "
        f"{len(rounds)} rounds)"
    )


def _done(run: Run) -> int:
    return run.summary.requests - run.summary.failed


def _group_order(name: str) -> tuple[int, str]:
    order = (*MESH_GROUPS, "triton", "load generator")
    return (order.index(name) if name in order else len(order), name)


def scaling_table(runs: list[Run]) -> str:
    """Output tokens/s of each load level relative to the first, per target."""
    lines = [
        "| target | load | output tok/s | relative to the first load |",
        "| --- | --- | --- | --- |",
    ]
    first: dict[str, float] = {}
    for run in runs:
        rate = run.summary.output_tokens_per_s
        base = first.setdefault(run.target, rate)
        relative = f"{rate / base:.2f}x" if base else "n/a"
        lines.append(f"| {run.target} | {run.load} | {rate:.0f} | {relative} |")
    return "\n".join(lines)


def update_markdown(path: Path, section: str, body: str) -> None:
    """Replaces (or appends) the block between this section's markers."""
    start, end = f"<!-- bench:{section}:start -->", f"<!-- bench:{section}:end -->"
    block = f"{start}\n{body.strip()}\n{end}"
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.S)
    text = pattern.sub(lambda _: block, text) if pattern.search(text) else f"{text}\n{block}\n"
    path.write_text(text)

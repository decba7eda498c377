"""What a request's steps cost when their code has gone cold: each step of the mesh's
path timed alone, hot (called back to back) and after an idle gap, as a request at
concurrency 1 finds it after waiting for the engine's prefill.

A gap of busy waiting instead of sleep tells whether the slowdown comes from the CPU's
sleep states (a busy wait keeps it awake) or from other work evicting this process's
code and data from the core's caches (a busy wait does not help).
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import re2
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt

from llmmesh.policy import Part, check_input
from llmmesh.policy.rules import RuleSet
from llmmesh.types import Chunk
from services.policy.config import DEFAULT_RULES

GAPS_S = (0.0, 0.0001, 0.001, 0.005, 0.02, 0.1)
BUSY_GAP_S = 0.02
PROMPT = "Summarise the meeting notes for the team: budget, hiring plan and the launch date."


@dataclass(frozen=True)
class Step:
    name: str
    call: Callable[[], object]


@dataclass(frozen=True)
class ColdRow:
    name: str
    hot_us: float
    after_gap_us: tuple[float, ...]  # per GAPS_S[1:]
    after_busy_us: float


def steps(loop: asyncio.AbstractEventLoop) -> list[Step]:
    """Code a request runs, from single library calls to one of the router's steps;
    ``loop`` runs the asynchronous ones."""
    rules = RuleSet.from_file(DEFAULT_RULES)
    parts = [Part("prompt", PROMPT)]
    pattern = re2.compile(r"\b\d{3}-\d{2}-\d{4}\b")
    separators = np.zeros(128, dtype=bool)
    separators[[ord(" "), ord("-"), ord(".")]] = True
    chunk = Chunk("text", 1, None)

    def keyword_view_in_numpy() -> object:
        codes = np.frombuffer(PROMPT.lower().encode("ascii"), dtype=np.uint8)
        keep = ~separators[codes]
        return codes[keep].tobytes().decode("ascii"), np.flatnonzero(keep)

    async def one_attempt() -> int:
        retrying = AsyncRetrying(
            stop=stop_after_attempt(3), retry=retry_if_exception_type(OSError), reraise=True
        )
        async for attempt in retrying:
            with attempt:
                return 1
        return 0

    def additions() -> int:
        total = 0
        for i in range(2000):
            total += i
        return total

    return [
        Step("one RE2 search", lambda: pattern.search(PROMPT)),
        Step("a keyword view in numpy", keyword_view_in_numpy),
        Step("the prompt check, default set", lambda: check_input(rules, parts)),
        Step("tenacity's retry loop, one attempt", lambda: loop.run_until_complete(one_attempt())),
        Step("a dataclass copy of a chunk", lambda: replace(chunk, num_tokens=2)),
        Step("a Python loop of 2,000 additions", additions),
    ]


def _timed(call: Callable[[], object], gap_s: float, busy: bool, calls: int) -> float:
    """Median µs of ``call`` after ``gap_s`` of sleep (or of busy waiting)."""
    times = []
    for _ in range(calls):
        if busy:
            until = time.perf_counter() + gap_s
            while time.perf_counter() < until:
                pass
        elif gap_s:
            time.sleep(gap_s)  # the idle gap is what is measured
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e6


def measure(calls: int = 100) -> list[ColdRow]:
    with asyncio.Runner() as runner:
        return [_row(step, calls) for step in steps(runner.get_loop())]


def _row(step: Step, calls: int) -> ColdRow:
    _timed(step.call, 0.0, False, calls)  # first calls: imports, caches filled
    return ColdRow(
        step.name,
        _timed(step.call, 0.0, False, calls),
        tuple(_timed(step.call, gap, False, calls) for gap in GAPS_S[1:]),
        _timed(step.call, BUSY_GAP_S, True, calls),
    )


def table(rows: list[ColdRow]) -> str:
    gaps = " | ".join(f"after {gap * 1000:g} ms idle" for gap in GAPS_S[1:])
    lines = [
        f"| code (µs, median) | hot | {gaps} | after {BUSY_GAP_S * 1000:g} ms busy |",
        "| --- |" + " --- |" * (len(GAPS_S) + 1),
    ]
    for row in rows:
        after = " | ".join(f"{us:.0f}" for us in row.after_gap_us)
        lines.append(f"| {row.name} | {row.hot_us:.1f} | {after} | {row.after_busy_us:.0f} |")
    return "\n".join(lines)

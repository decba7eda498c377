"""The cold-code scenario (bench/cold.py): each step it times is a working call of the
mesh's own code, and its table names every gap."""

from __future__ import annotations

import asyncio

from bench.cold import GAPS_S, PROMPT, ColdRow, steps, table
from llmmesh.policy.parts import PartsDecision


def test_every_step_runs() -> None:
    with asyncio.Runner() as runner:
        results = {step.name: step.call() for step in steps(runner.get_loop())}
    check = results["the prompt check, default set"]
    assert isinstance(check, PartsDecision)
    assert (check.texts, check.denied_by, check.redacted) == ((PROMPT,), None, False)
    assert results["tenacity's retry loop, one attempt"] == 1
    assert results["a Python loop of 2,000 additions"] == sum(range(2000))


def test_the_table_has_a_column_per_gap() -> None:
    row = ColdRow("step", 1.0, tuple(float(i) for i in range(len(GAPS_S) - 1)), 7.0)
    header, rule, line = table([row]).splitlines()
    assert header.count("|") == rule.count("|") == line.count("|") == len(GAPS_S) + 3
    assert "after 20 ms busy" in header and line.endswith("| 7 |")

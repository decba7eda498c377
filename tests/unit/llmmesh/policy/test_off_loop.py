"""A long prompt's input check runs beside the event loop; a short one on it."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator

import pytest

from llmmesh.policy import DETECTORS, Part, RuleSet, RuleSetSpec, register_detector
from llmmesh.policy.off_loop import input_verdict_off_loop
from llmmesh.runtime.beside_loop import ON_LOOP_CHARS
from llmmesh.types import PolicyAction

MARK = "waitmark"


@pytest.fixture
def rules_calling() -> Iterator[Callable[[Callable[[], bool]], RuleSet]]:
    """Rules that redact MARK, calling ``seen`` on the thread the check runs on."""

    def make(seen: Callable[[], bool]) -> RuleSet:
        register_detector("test_off_loop", "[MARK]", rf"\b{MARK}\b", lambda _: seen())
        spec = {
            "version": "t",
            "rules": [{"id": "mark", "action": "redact", "detectors": ["test_off_loop"]}],
        }
        return RuleSet.from_spec(RuleSetSpec.model_validate(spec))

    yield make
    DETECTORS.pop("test_off_loop", None)


def test_the_loop_runs_while_a_long_prompt_is_checked(
    rules_calling: Callable[[Callable[[], bool]], RuleSet],
) -> None:
    """The check waits for the loop to take a turn: on the loop's own thread it would wait
    its whole timeout, and no turn would come."""
    loop_turned = threading.Event()
    waits: list[bool] = []

    def seen() -> bool:
        waits.append(loop_turned.wait(timeout=5))
        return True

    rules = rules_calling(seen)
    text = "word " * (ON_LOOP_CHARS // 5) + MARK + " end"

    async def scenario() -> PolicyAction:
        asyncio.get_running_loop().call_soon(loop_turned.set)
        verdict = await input_verdict_off_loop(rules, [Part("prompt", text)])
        assert verdict.texts == (text.replace(MARK, "[MARK]"),)
        return verdict.action

    assert asyncio.run(scenario()) is PolicyAction.REDACT
    assert waits == [True]


def test_a_short_prompt_is_checked_on_the_loops_thread(
    rules_calling: Callable[[Callable[[], bool]], RuleSet],
) -> None:
    threads: list[int] = []

    def seen() -> bool:
        threads.append(threading.get_ident())
        return True

    rules = rules_calling(seen)
    parts = [Part("messages[0].content", f"a {MARK}"), Part("messages[1].content", "b")]

    async def scenario() -> str:
        verdict = await input_verdict_off_loop(rules, parts)
        return verdict.texts[0]

    assert asyncio.run(scenario()) == "a [MARK]"
    assert threads == [threading.get_ident()]


def test_tenants_long_checks_take_turns() -> None:
    """A tenant that sends many long prompts at once waits for its own checks: another
    tenant's, sent after them, is checked next."""
    checked: list[str] = []
    first_running, first_may_end = threading.Event(), threading.Event()

    def seen(mark: str) -> bool:
        checked.append(mark)
        if mark == "marka1":
            first_running.set()
            first_may_end.wait(timeout=5)
        return True

    register_detector("test_turns", "[MARK]", r"\bmark\w+\b", seen)
    spec = {"version": "t", "rules": [{"id": "m", "action": "redact", "detectors": ["test_turns"]}]}
    rules = RuleSet.from_spec(RuleSetSpec.model_validate(spec))

    def check(tenant: str, mark: str) -> asyncio.Future[object]:
        text = "word " * (ON_LOOP_CHARS // 5) + mark
        return asyncio.ensure_future(input_verdict_off_loop(rules, [Part("p", text)], tenant))

    async def scenario() -> None:
        first = check("a", "marka1")
        assert await asyncio.to_thread(first_running.wait, 5)
        others = [check("a", "marka2"), check("a", "marka3"), check("b", "markb1")]
        asyncio.get_running_loop().call_soon(first_may_end.set)  # once they are queued
        await asyncio.gather(first, *others)

    try:
        asyncio.run(scenario())
    finally:
        DETECTORS.pop("test_turns", None)
    assert checked == ["marka1", "markb1", "marka2", "marka3"]

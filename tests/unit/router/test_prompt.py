from __future__ import annotations

from dataclasses import replace

import pytest

from llmmesh.runtime.errors import InvalidArgument
from llmmesh.types import History, Role, Turn
from services.context.store import Session
from services.context.truncation import Budget, truncate
from services.router.prompt import (
    SUMMARY_LEAD,
    build_prompt,
    input_parts,
    summary_overhead,
    turn_overhead,
    user_tail,
    with_texts,
)


def count(text: str) -> int:
    return len(text.encode())


def history(*turns: Turn, system: str = "", summary: str = "") -> History:
    return History(turns=turns, system_prompt=system, summary=summary)


def test_next_turn_prompt_extends_the_previous_prompt_and_answer() -> None:
    first, dropped = build_prompt(history(system="Be kind."), "hello", 1000, count)
    assert dropped == 0
    grown = history(Turn(Role.USER, "hello"), Turn(Role.ASSISTANT, " world!"), system="Be kind.")
    second, _ = build_prompt(grown, "again", 1000, count)
    assert second.startswith(first + " world!")
    assert second.startswith("<|system|>\nBe kind.\n<|user|>\nhello\n")
    assert second.endswith("again\n<|assistant|>\n")


def test_a_summary_goes_after_the_system_prompt_and_before_the_turns() -> None:
    prompt, _ = build_prompt(
        history(Turn(Role.USER, "q"), system="S", summary="They met."), "now", 1000, count
    )
    assert prompt.index("S\n") < prompt.index(SUMMARY_LEAD + "They met.") < prompt.index("q\n")


def test_the_tools_go_after_the_system_prompt_and_policy_reads_them_as_tools() -> None:
    """Each part is named for policy and comes back in place, redacted or not."""
    asked = history(Turn(Role.USER, "q"), system="S", summary="They met.")
    shown = replace(asked, tools="T", total_turns=1)
    prompt, _ = build_prompt(shown, "now", 1000, count)
    assert prompt.index("S\n") < prompt.index("T\n") < prompt.index(SUMMARY_LEAD)
    parts = input_parts(shown, "now", None)
    assert [p.field for p in parts] == [
        "session.system_prompt",
        "tools",
        "session.summary",
        "session.turns[0]",
        "prompt",
    ]
    checked, text = with_texts(shown, ("S", "T'", "They met.", "q", "now"))
    assert checked is not None and (checked.tools, checked.system_prompt) == ("T'", "S")
    assert text == "now"


def test_what_still_does_not_fit_is_dropped_oldest_first() -> None:
    turns = [Turn(Role.USER, f"turn {i} " + "x" * 50) for i in range(10)]
    prompt, dropped = build_prompt(history(*turns), "now", 200, count)
    assert count(prompt) <= 200
    assert dropped > 0
    assert "turn 9" in prompt
    assert "turn 0" not in prompt


def test_prompt_that_cannot_fit_is_invalid() -> None:
    with pytest.raises(InvalidArgument) as info:
        build_prompt(history(), "x" * 100, 50, count)
    assert info.value.field == "prompt"


def test_without_a_session_the_prompt_is_sent_as_is() -> None:
    assert build_prompt(None, "complete this", 100, count) == ("complete this", 0)


@pytest.mark.parametrize("strategy", ["last_turns", "sliding_summary"])
def test_a_history_whose_prompt_fits_is_not_cut(strategy: str) -> None:
    """The context service's accounting (text plus turn_overhead per turn, the summary's
    lead-in once) must not cut what the prompt can hold: a cut history shares no prefix
    with the previous turn's prompt, so the engine's cache would miss."""
    turns = [
        Turn(Role.USER if i % 2 == 0 else Role.ASSISTANT, f"turn {i} " + "x" * 90)
        for i in range(12)
    ]
    full, _ = build_prompt(history(*turns, system="Be kind."), "now", 10_000, count)
    # A model whose context holds that prompt with 10 tokens to spare per turn, and what
    # the router asks the context service for within it.
    context = count(full) + 10 * len(turns)
    room = context - count(user_tail("now")) - summary_overhead(count)
    cut = truncate(
        Session(system_prompt="Be kind.", turns=turns),
        Budget(room, turn_overhead(count)),
        strategy,
        count,
    )
    assert cut.dropped == []
    assert cut.turns == turns

from __future__ import annotations

import pytest

from llmmesh.runtime.errors import InvalidArgument
from llmmesh.types import Role, Turn
from services.router.prompt import build_prompt


def count(text: str) -> int:
    return len(text.encode())


def test_next_turn_prompt_extends_the_previous_prompt_and_answer() -> None:
    first, dropped = build_prompt([], "hello", 1000, count)
    assert dropped == 0
    history = [Turn(Role.USER, "hello"), Turn(Role.ASSISTANT, " world!")]
    second, _ = build_prompt(history, "again", 1000, count)
    assert second.startswith(first + " world!")
    assert second.endswith("again\n<|assistant|>\n")


def test_oldest_turns_are_dropped_to_fit_the_budget() -> None:
    history = [Turn(Role.USER, f"turn {i} " + "x" * 50) for i in range(10)]
    prompt, dropped = build_prompt(history, "now", 200, count)
    assert count(prompt) <= 200
    assert dropped > 0
    assert "turn 9" in prompt
    assert "turn 0" not in prompt


def test_prompt_that_cannot_fit_is_invalid() -> None:
    with pytest.raises(InvalidArgument) as info:
        build_prompt([], "x" * 100, 50, count)
    assert info.value.field == "prompt"


def test_without_a_session_the_prompt_is_sent_as_is() -> None:
    assert build_prompt(None, "complete this", 100, count) == ("complete this", 0)

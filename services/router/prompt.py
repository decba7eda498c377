"""Builds the model prompt from a session's history and the new user message.

The layout is append-only: the prompt of turn N+1 starts with the exact text of turn N's
prompt followed by turn N's answer, so engine prefix caches and session affinity pay off.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from llmmesh.runtime.errors import InvalidArgument
from llmmesh.types import Role, Turn

_TAGS = {Role.SYSTEM: "<|system|>", Role.USER: "<|user|>", Role.ASSISTANT: "<|assistant|>"}


def render_turn(turn: Turn) -> str:
    return f"{_TAGS[turn.role]}\n{turn.text}\n"


def build_prompt(
    history: Sequence[Turn] | None,
    user_text: str,
    budget_tokens: int,
    count_tokens: Callable[[str], int],
) -> tuple[str, int]:
    """Returns (prompt, dropped turns): the most recent history that fits ``budget_tokens``.

    Without a session (``history`` is None) the prompt goes to the model as it is, a plain
    completion; a session's turns are laid out in the chat format.
    """
    tail = (
        user_text
        if history is None
        else render_turn(Turn(Role.USER, user_text)) + _TAGS[Role.ASSISTANT] + "\n"
    )
    used = count_tokens(tail)
    if used > budget_tokens:
        raise InvalidArgument(
            "prompt",
            f"{used} tokens leave no room for generation in the model's context "
            f"({budget_tokens} tokens available after max_tokens)",
        )
    kept: list[str] = []
    for turn in reversed(history or ()):
        rendered = render_turn(turn)
        cost = count_tokens(rendered)
        if used + cost > budget_tokens:
            break
        kept.append(rendered)
        used += cost
    kept.reverse()
    return "".join(kept) + tail, len(history or ()) - len(kept)

"""Builds the model prompt from a session's history and the new user message.

The layout is append-only: the system prompt, a summary of older turns (once the context
service had to fold some), then the turns. Unless the history was cut, the prompt of turn
N+1 starts with the exact text of turn N's prompt followed by turn N's answer, so engine
prefix caches and session affinity pay off.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from llmmesh.policy import Part
from llmmesh.runtime.errors import InvalidArgument
from llmmesh.types import History, Role, Turn

_TAGS = {Role.SYSTEM: "<|system|>", Role.USER: "<|user|>", Role.ASSISTANT: "<|assistant|>"}
SUMMARY_LEAD = "Earlier in this conversation: "


def render_turn(turn: Turn) -> str:
    return f"{_TAGS[turn.role]}\n{turn.text}\n"


def turn_overhead(count_tokens: Callable[[str], int]) -> int:
    """Tokens a rendered turn adds to its text: the longest role tag and separators."""
    return max(count_tokens(render_turn(Turn(role, ""))) for role in Role)


def summary_overhead(count_tokens: Callable[[str], int]) -> int:
    """Tokens a summary of older turns adds beyond a turn's: its lead-in, once. Charged
    per turn, it would cut a history that fits, and a cut history shares no prefix with
    the previous turn's prompt, so the engine's cache would miss for the whole prompt."""
    return count_tokens(SUMMARY_LEAD)


def user_tail(user_text: str) -> str:
    """What follows the history: the new message and the assistant's cue."""
    return render_turn(Turn(Role.USER, user_text)) + _TAGS[Role.ASSISTANT] + "\n"


def _preamble(history: History) -> list[Turn]:
    turns = []
    if history.system_prompt:
        turns.append(Turn(Role.SYSTEM, history.system_prompt))
    if history.summary:
        turns.append(Turn(Role.SYSTEM, SUMMARY_LEAD + history.summary))
    return turns


def build_prompt(
    history: History | None,
    user_text: str,
    budget_tokens: int,
    count_tokens: Callable[[str], int],
) -> tuple[str, int]:
    """Returns (prompt, turns dropped here): the history within ``budget_tokens``.

    The context service cuts the history to the budget already; what would still not fit
    (it counted differently, or an older service) is dropped here, oldest first. Without a
    session (``history`` is None) the prompt goes to the model as it is, a plain
    completion; a session's turns are laid out in the chat format.
    """
    tail = user_text if history is None else user_tail(user_text)
    used = count_tokens(tail)
    if used > budget_tokens:
        raise InvalidArgument(
            "prompt",
            f"{used} tokens leave no room for generation in the model's context "
            f"({budget_tokens} tokens available after max_tokens)",
        )
    turns = [*_preamble(history), *history.turns] if history else []
    kept: list[str] = []
    for turn in reversed(turns):
        rendered = render_turn(turn)
        cost = count_tokens(rendered)
        if used + cost > budget_tokens:
            break
        kept.append(rendered)
        used += cost
    kept.reverse()
    return "".join(kept) + tail, len(turns) - len(kept)


def input_parts(history: History | None, prompt: str, inline: bool) -> list[Part]:
    """Everything the model will read, in the order it reads it, each part named by the
    request field it came from: the messages of a conversation sent whole (``inline``),
    or a stored session's system prompt, summary and turns; then the new message."""
    parts: list[Part] = []
    turns = history.turns if history else ()
    if history is not None:
        if history.system_prompt:
            parts.append(Part("session.system_prompt", history.system_prompt))
        if history.summary:
            parts.append(Part("session.summary", history.summary))
    first_stored = (history.total_turns - len(turns)) if history else 0
    for index, turn in enumerate(turns):
        field = f"messages[{index}].content" if inline else f"session.turns[{first_stored + index}]"
        parts.append(Part(field, turn.text))
    parts.append(Part(f"messages[{len(turns)}].content" if inline else "prompt", prompt))
    return parts


def with_texts(history: History | None, texts: tuple[str, ...]) -> tuple[History | None, str]:
    """The history and new message of ``input_parts`` with the parts' texts replaced (by
    their redacted texts), in the same order."""
    *earlier, prompt = texts
    if history is None:
        return None, prompt
    pieces = iter(earlier)
    system = next(pieces) if history.system_prompt else ""
    summary = next(pieces) if history.summary else ""
    turns = tuple(replace(turn, text=next(pieces)) for turn in history.turns)
    return replace(history, system_prompt=system, summary=summary, turns=turns), prompt

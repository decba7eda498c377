"""Builds the model prompt from a session's history and the new user message.

The layout is append-only: the system prompt, a summary of older turns (once the context
service had to fold some), then the turns. Unless the history was cut, the prompt of turn
N+1 starts with the exact text of turn N's prompt followed by turn N's answer, so engine
prefix caches and session affinity pay off.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import replace

from llmmesh.policy import Part
from llmmesh.runtime.errors import InvalidArgument
from llmmesh.types import History, Role, Turn
from services.router.chat_layout import MESH_LAYOUT, ChatLayout

SUMMARY_LEAD = "Earlier in this conversation: "
# A message the layout's framing is measured after (a template may add text of its own
# before the first message, e.g. a default system prompt, but never after another).
_ANCHOR = Turn(Role.SYSTEM, "anchor")


@functools.lru_cache(maxsize=64)
def _anchor(layout: ChatLayout) -> str:
    return layout.render([_ANCHOR], generation_prompt=False)


def _after_anchor(layout: ChatLayout, turns: list[Turn], generation_prompt: bool) -> str:
    """What ``turns`` add to a conversation already under way."""
    whole = layout.render([_ANCHOR, *turns], generation_prompt=generation_prompt)
    return _past_anchor(layout, whole)


def _past_anchor(layout: ChatLayout, whole: str) -> str:
    """``whole``, a conversation rendered after the anchor message, without it."""
    before = _anchor(layout)
    return whole[len(before) :] if whole.startswith(before) else whole


@functools.lru_cache(maxsize=64)  # the same for every request to a model
def turn_overhead(count_tokens: Callable[[str], int], layout: ChatLayout = MESH_LAYOUT) -> int:
    """Tokens a turn adds to its text, at most: its role's framing in the layout."""
    return max(count_tokens(_after_anchor(layout, [Turn(role, "")], False)) for role in Role)


def summary_overhead(count_tokens: Callable[[str], int]) -> int:
    """Tokens a summary of older turns adds beyond a turn's: its lead-in, once. Charged
    per turn, it would cut a history that fits, and a cut history shares no prefix with
    the previous turn's prompt, so the engine's cache would miss for the whole prompt."""
    return count_tokens(SUMMARY_LEAD)


def user_tail(user_text: str, layout: ChatLayout = MESH_LAYOUT, role: Role = Role.USER) -> str:
    """What follows the history: the new message and the assistant's cue (or, the
    assistant's, the start of its answer, left open)."""
    return _past_anchor(layout, render_last(layout, [_ANCHOR], Turn(role, user_text)))


def render_last(layout: ChatLayout, turns: list[Turn], last: Turn) -> str:
    """``turns`` and then ``last``: a user's message followed by the assistant's cue, or
    an assistant's left open for the model to continue (vLLM's continue_final_message):
    the conversation as the layout writes it, cut where that message's text ends."""
    if last.role is not Role.ASSISTANT:
        return layout.render([*turns, last], generation_prompt=True)
    whole = layout.render([*turns, last], generation_prompt=False)
    for text in (last.text, last.text.strip()):  # a template may strip the message
        end = whole.rfind(text) if text else -1
        if end >= 0:
            return whole[: end + len(text)]
    raise InvalidArgument(
        "prompt", "the model's chat template does not write this message: it cannot go on"
    )


def _preamble(history: History) -> list[Turn]:
    turns = []
    if history.system_prompt:
        turns.append(Turn(Role.SYSTEM, history.system_prompt))
    if history.tools:
        turns.append(Turn(Role.SYSTEM, history.tools))
    if history.summary:
        turns.append(Turn(Role.SYSTEM, SUMMARY_LEAD + history.summary))
    return turns


def build_prompt(
    history: History | None,
    user_text: str,
    budget_tokens: int,
    count_tokens: Callable[[str], int],
    layout: ChatLayout = MESH_LAYOUT,
    *,
    role: Role = Role.USER,
) -> tuple[str, int]:
    """Returns (prompt, turns dropped here): the history within ``budget_tokens``.

    The context service cuts the history to the budget already; what would still not fit
    (it counted differently, or an older service) is dropped here, oldest first. Without a
    session (``history`` is None) the prompt goes to the model as it is, a plain
    completion; a session's turns are laid out in the model's chat layout, and then the
    new message: the user's, or the start of the assistant's answer (``role``).
    """
    if history is None:
        _check_fits(count_tokens(user_text), budget_tokens)
        return user_text, 0
    turns = [*_preamble(history), *history.turns]
    last = Turn(role, user_text)
    first = _first_kept(turns, last, budget_tokens, count_tokens, layout)
    while True:  # the estimate per turn, checked on the whole: a template may add its own
        prompt = render_last(layout, turns[first:], last)
        used = count_tokens(prompt)
        if used <= budget_tokens or first == len(turns):
            _check_fits(used, budget_tokens)
            return prompt, first
        first += 1


def _first_kept(
    turns: list[Turn],
    last: Turn,
    budget_tokens: int,
    count_tokens: Callable[[str], int],
    layout: ChatLayout,
) -> int:
    """The oldest turn of the longest run of recent turns that fits, by each turn's own
    rendering."""
    used = count_tokens(user_tail(last.text, layout, last.role))
    _check_fits(used, budget_tokens)
    first = len(turns)
    while first > 0:
        cost = count_tokens(_after_anchor(layout, [turns[first - 1]], False))
        if used + cost > budget_tokens:
            break
        used += cost
        first -= 1
    return first


def _check_fits(used: int, budget_tokens: int) -> None:
    if used > budget_tokens:
        raise InvalidArgument(
            "prompt",
            f"{used} tokens leave no room for generation in the model's context "
            f"({budget_tokens} tokens available after max_tokens)",
        )


def input_parts(
    history: History | None,
    prompt: str,
    written_turns: int | None,
    field: str | Callable[[int], str] = "messages",
    *,
    instructions: bool = False,
    prompt_field: str = "prompt",
) -> list[Part]:
    """Everything the model will read, in the order it reads it, each part named by the
    request field it came from: a stored session's system prompt (or the request's
    ``instructions`` in its place), the request's tools, the summary and turns; then the
    last ``written_turns`` turns, which the client wrote (``field[i].content``, or
    ``field(i)``: the messages of a conversation sent whole, or the items that continue a
    session); then the new message. None: no turns of the client's, the message is the
    ``prompt_field``."""
    name_of = field if callable(field) else (lambda i: f"{field}[{i}].content")
    parts: list[Part] = []
    turns = history.turns if history else ()
    if history is not None:
        if history.system_prompt:
            name = "instructions" if instructions else "session.system_prompt"
            parts.append(Part(name, history.system_prompt))
        if history.tools:
            parts.append(Part("tools", history.tools))
        if history.summary:
            parts.append(Part("session.summary", history.summary))
    stored = len(turns) - (written_turns or 0)
    first_stored = (history.total_turns - len(turns)) if history else 0
    for index, turn in enumerate(turns):
        if index < stored:
            parts.append(Part(f"session.turns[{first_stored + index}]", turn.text))
        else:
            parts.append(Part(name_of(index - stored), turn.text))
    last = prompt_field if written_turns is None else name_of(len(turns) - stored)
    parts.append(Part(last, prompt))
    return parts


def continued(stored: History, new_turns: tuple[Turn, ...], instructions: str | None) -> History:
    """A session's history followed by the turns the request adds to it, with the
    request's system prompt if it brings one."""
    return replace(
        stored,
        turns=stored.turns + new_turns,
        system_prompt=stored.system_prompt if instructions is None else instructions,
        total_turns=stored.total_turns + len(new_turns),
    )


def with_texts(history: History | None, texts: tuple[str, ...]) -> tuple[History | None, str]:
    """The history and new message of ``input_parts`` with the parts' texts replaced (by
    their redacted texts), in the same order."""
    *earlier, prompt = texts
    if history is None:
        return None, prompt
    pieces = iter(earlier)
    system = next(pieces) if history.system_prompt else ""
    tools = next(pieces) if history.tools else ""
    summary = next(pieces) if history.summary else ""
    turns = tuple(replace(turn, text=next(pieces)) for turn in history.turns)
    checked = replace(history, system_prompt=system, tools=tools, summary=summary, turns=turns)
    return checked, prompt

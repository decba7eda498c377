"""Cutting a session to a token budget. Pure functions: a session in, what goes into the
prompt (and what was dropped) out.

The budget covers the system prompt, a summary of older turns and the kept turns, each
rendered with ``turn_overhead`` tokens of role tags. Without truncation every strategy
keeps everything, so the prompt of the next turn starts with this one's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from llmmesh.runtime.errors import InvalidArgument
from llmmesh.sentences import Scored, score, score_by_later_turns, select, sentences
from llmmesh.types import Fold, Truncation, Turn, check_truncation
from services.context.store import Session

Count = Callable[[str], int]

LAST_TURNS = Truncation.LAST_TURNS
KEEP_SYSTEM_AND_RECENT = Truncation.KEEP_SYSTEM_AND_RECENT
SLIDING_SUMMARY = Truncation.SLIDING_SUMMARY
KEY_SENTENCES = Truncation.KEY_SENTENCES
MODEL_SUMMARY = Truncation.MODEL_SUMMARY
STRATEGIES = tuple(Truncation)

SUMMARY_SHARE = 0.25  # of the budget, at most, for a summary or key sentences
# When sliding_summary must fold, it folds until the kept turns use this share of their
# room: the next turns then fit without folding again, and the prompt prefix holds.
REFOLD_SHARE = 0.6
# model_summary asks for a fold once the turns after its summary fill this share of their
# room: the model writes it in the background, before they outgrow it.
FOLD_AT_SHARE = 0.8


@dataclass(frozen=True)
class Budget:
    tokens: int
    turn_overhead: int = 0

    def __post_init__(self) -> None:
        if self.tokens < 0:
            raise InvalidArgument("budget_tokens", f"must be >= 0, got {self.tokens}")
        if self.turn_overhead < 0:
            raise InvalidArgument("turn_overhead_tokens", f"must be >= 0, got {self.turn_overhead}")


@dataclass(frozen=True)
class Truncated:
    strategy: str
    system_prompt: str  # empty when dropped (or there is none)
    summary: str  # stands for older turns; empty when none
    turns: list[Turn]  # kept whole, oldest first
    dropped: list[Turn]  # not kept whole, oldest first
    summarized_turns: int = 0  # of the dropped, how many the summary covers
    system_prompt_dropped: bool = False
    dropped_sentences: int = 0  # key_sentences: sentences of dropped turns left out
    stored_summary: tuple[str, int] | None = None  # sliding_summary: a new summary to keep
    fold: Fold | None = None  # model_summary: turns for the model to fold into the summary
    # key_sentences: the left-out turns' sentences, scored, and the room for an excerpt of
    # them, for a caller that knows the next message to choose again (the router does).
    candidates: tuple[Scored, ...] = ()
    excerpt_tokens: int = 0


def check_strategy(strategy: str) -> Truncation:
    return check_truncation(strategy)


def truncate(session: Session, budget: Budget, strategy: str, count: Count) -> Truncated:
    strategy = check_strategy(strategy)
    if strategy == MODEL_SUMMARY and budget.tokens:
        return _model_summary(session, budget, count)
    if budget.tokens == 0 or _cost(session, budget, count) <= budget.tokens:
        return Truncated(strategy, session.system_prompt, "", list(session.turns), [])
    if strategy == LAST_TURNS:
        return _last_turns(session, budget, count)
    if strategy == KEEP_SYSTEM_AND_RECENT:
        return _keep_system_and_recent(session, budget, count)
    if strategy == SLIDING_SUMMARY:
        return _sliding_summary(session, budget, count)
    return _key_sentences(session, budget, count)


def _cost(session: Session, budget: Budget, count: Count) -> int:
    system = _text_cost(session.system_prompt, budget, count)
    return system + sum(_turn_cost(t, budget, count) for t in session.turns)


def _text_cost(text: str, budget: Budget, count: Count) -> int:
    return count(text) + budget.turn_overhead if text else 0


def _turn_cost(turn: Turn, budget: Budget, count: Count) -> int:
    return (turn.token_count or count(turn.text)) + budget.turn_overhead


def _recent(turns: Sequence[Turn], room: int, budget: Budget, count: Count) -> int:
    """How many of the most recent turns fit in ``room`` tokens."""
    used = kept = 0
    for turn in reversed(turns):
        used += _turn_cost(turn, budget, count)
        if used > room:
            break
        kept += 1
    return kept


def _split(turns: list[Turn], kept: int) -> tuple[list[Turn], list[Turn]]:
    cut = len(turns) - kept
    return turns[:cut], turns[cut:]


def _last_turns(session: Session, budget: Budget, count: Count) -> Truncated:
    """The most recent turns that fit; the system prompt only if it fits after them."""
    dropped, kept = _split(session.turns, _recent(session.turns, budget.tokens, budget, count))
    used = sum(_turn_cost(t, budget, count) for t in kept)
    system = session.system_prompt
    fits = used + _text_cost(system, budget, count) <= budget.tokens
    return Truncated(
        LAST_TURNS,
        system if fits else "",
        "",
        kept,
        dropped,
        system_prompt_dropped=bool(system) and not fits,
    )


def _system_room(session: Session, budget: Budget, count: Count) -> int:
    room = budget.tokens - _text_cost(session.system_prompt, budget, count)
    if room < 0:
        raise InvalidArgument(
            "budget_tokens",
            f"{budget.tokens} tokens cannot hold the system prompt "
            f"({_text_cost(session.system_prompt, budget, count)} tokens)",
        )
    return room


def _keep_system_and_recent(session: Session, budget: Budget, count: Count) -> Truncated:
    room = _system_room(session, budget, count)
    dropped, kept = _split(session.turns, _recent(session.turns, room, budget, count))
    return Truncated(KEEP_SYSTEM_AND_RECENT, session.system_prompt, "", kept, dropped)


def _sliding_summary(session: Session, budget: Budget, count: Count) -> Truncated:
    """Recent turns whole; older ones folded into a stored extractive summary that grows
    only when more turns must be folded (so the prompt's start stays put in between)."""
    room = _system_room(session, budget, count)
    summary_room = int(room * SUMMARY_SHARE)
    turns_room = room - summary_room
    covered = min(session.summarized_turns, len(session.turns))
    unfolded = session.turns[covered:]
    if covered and _fits(unfolded, turns_room, budget, count):
        kept, summary, stored = unfolded, session.summary, None
    else:
        keep = _recent(session.turns, int(turns_room * REFOLD_SHARE), budget, count)
        folded, kept = _split(session.turns, keep)
        summary = _fold(session, folded[covered:], kept, summary_room, budget=budget, count=count)
        covered, stored = len(folded), (summary, len(folded))
    dropped = session.turns[: len(session.turns) - len(kept)]
    return Truncated(
        SLIDING_SUMMARY,
        session.system_prompt,
        summary,
        list(kept),
        dropped,
        summarized_turns=covered,
        stored_summary=stored,
    )


def _fits(turns: Sequence[Turn], room: int, budget: Budget, count: Count) -> bool:
    return sum(_turn_cost(t, budget, count) for t in turns) <= room


def _fold(
    session: Session,
    newly_folded: Sequence[Turn],
    kept: Sequence[Turn],
    room: int,
    *,
    budget: Budget,
    count: Count,
) -> str:
    """The stored summary's sentences and the newly folded turns', the best that fit."""
    candidates = sentences(session.summary) + [
        s for turn in newly_folded for s in sentences(turn.text)
    ]
    scored = score(candidates, [t.text for t in kept])
    return " ".join(select(scored, max(room - budget.turn_overhead, 0), count))


def _key_sentences(session: Session, budget: Budget, count: Count) -> Truncated:
    """Recent turns whole; of the older ones, the sentences later turns refer to most."""
    room = _system_room(session, budget, count)
    excerpt_room = int(room * SUMMARY_SHARE)
    dropped, kept = _split(
        session.turns, _recent(session.turns, room - excerpt_room, budget, count)
    )
    scored = score_by_later_turns([t.text for t in session.turns])
    candidates = scored[: sum(len(sentences(t.text)) for t in dropped)]  # dropped turns'
    room = max(excerpt_room - budget.turn_overhead, 0)
    chosen = select(candidates, room, count)
    return Truncated(
        KEY_SENTENCES,
        session.system_prompt,
        " ".join(chosen),
        kept,
        dropped,
        summarized_turns=len(dropped) if chosen else 0,
        dropped_sentences=len(candidates) - len(chosen),
        candidates=tuple(candidates),
        excerpt_tokens=room,
    )


def _model_summary(session: Session, budget: Budget, count: Count) -> Truncated:
    """Recent turns whole; older ones folded into a summary the model writes (the router
    asks it, in the background, and stores it): the summary and the turns after it, as
    many as fit. Once those turns fill FOLD_AT_SHARE of their room, the reply asks for a
    fold of the oldest of them, so that a new summary is stored before they outgrow it;
    until it is, turns that do not fit are left out. The summary changes only when a
    fold is stored, so the prompt's start stays put in between."""
    room = _system_room(session, budget, count)
    summary_room = int(room * SUMMARY_SHARE)
    turns_room = room - summary_room
    covered = min(session.summarized_turns, len(session.turns))
    summary = session.summary if covered else ""
    unfolded = session.turns[covered:]
    if not covered and _cost(session, budget, count) <= budget.tokens:
        kept: Sequence[Turn] = unfolded  # nothing folded yet and everything fits
    else:
        kept = unfolded[len(unfolded) - _recent(unfolded, turns_room, budget, count) :]
    fold = None
    if not _fits(unfolded, int(turns_room * FOLD_AT_SHARE), budget, count):
        keep = _recent(unfolded, int(turns_room * REFOLD_SHARE), budget, count)
        folded = unfolded[: len(unfolded) - keep]
        if folded:
            max_tokens = max(summary_room - budget.turn_overhead, 0)
            fold = Fold(summary, covered, tuple(folded), covered + len(folded), max_tokens)
    return Truncated(
        MODEL_SUMMARY,
        session.system_prompt,
        summary,
        list(kept),
        session.turns[: len(session.turns) - len(kept)],
        summarized_turns=covered,
        fold=fold,
    )

"""Truncation strategies: what each keeps within the budget, and what it reports dropped."""

from __future__ import annotations

import pytest

from llmmesh.runtime.errors import InvalidArgument
from llmmesh.sentences import relevant_to, select
from llmmesh.types import Role, Turn, count_tokens
from services.context.store import Session
from services.context.truncation import (
    KEY_SENTENCES,
    MODEL_SUMMARY,
    SLIDING_SUMMARY,
    STRATEGIES,
    Budget,
    truncate,
)

OVERHEAD = 4


def turn(role: Role, text: str, request_id: str) -> Turn:
    return Turn(role, text, count_tokens(text), request_id)


def conversation(rounds: int) -> list[Turn]:
    turns = []
    for i in range(rounds):
        turns.append(turn(Role.USER, f"Question {i}: what about topic{i}?", f"r{i}"))
        turns.append(turn(Role.ASSISTANT, f"Answer {i} explains topic{i} in a sentence.", f"r{i}"))
    return turns


def cost(turns: list[Turn]) -> int:
    return sum(t.token_count + OVERHEAD for t in turns)


SYSTEM = "You are a helpful assistant."
SESSION = Session(system_prompt=SYSTEM, turns=conversation(10))
FULL = cost(SESSION.turns) + count_tokens(SYSTEM) + OVERHEAD


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_session_that_fits_is_kept_whole(strategy: str) -> None:
    cut = truncate(SESSION, Budget(FULL, OVERHEAD), strategy, count_tokens)
    assert (cut.system_prompt, cut.turns, cut.dropped, cut.summary) == (
        SYSTEM,
        SESSION.turns,
        [],
        "",
    )


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_strategy_fits_the_budget_and_reports_what_it_dropped(strategy: str) -> None:
    budget = Budget(FULL // 2, OVERHEAD)
    cut = truncate(SESSION, budget, strategy, count_tokens)
    used = cost(cut.turns) + sum(
        count_tokens(text) + OVERHEAD for text in (cut.system_prompt, cut.summary) if text
    )
    assert used <= budget.tokens
    assert cut.dropped == SESSION.turns[: len(cut.dropped)]  # the oldest
    assert cut.dropped + cut.turns == SESSION.turns
    assert cut.dropped


def test_last_turns_drops_the_system_prompt_before_a_recent_turn() -> None:
    budget = Budget(cost(SESSION.turns[-4:]), OVERHEAD)
    cut = truncate(SESSION, budget, "last_turns", count_tokens)
    assert cut.turns == SESSION.turns[-4:]
    assert cut.system_prompt == "" and cut.system_prompt_dropped


def test_keep_system_and_recent_always_keeps_the_system_prompt() -> None:
    budget = Budget(cost(SESSION.turns[-4:]), OVERHEAD)
    cut = truncate(SESSION, budget, "keep_system_and_recent", count_tokens)
    assert cut.system_prompt == SYSTEM
    assert cut.turns == SESSION.turns[-3:]
    with pytest.raises(InvalidArgument, match="cannot hold the system prompt"):
        truncate(SESSION, Budget(5, OVERHEAD), "keep_system_and_recent", count_tokens)


def test_sliding_summary_folds_old_turns_and_keeps_the_prefix_until_it_must_fold_again() -> None:
    budget = Budget(FULL * 2 // 3, OVERHEAD)
    first = truncate(SESSION, budget, SLIDING_SUMMARY, count_tokens)
    assert first.stored_summary is not None and first.summary
    summary, covered = first.stored_summary
    assert covered == first.summarized_turns == len(first.dropped)
    # The summary keeps what the recent turns talk about.
    recent_topics = {f"topic{i}" for i in range(10)} & set(
        " ".join(t.text for t in first.turns).replace("?", " ").replace(".", " ").split()
    )
    assert recent_topics

    # Next turn: the stored summary is used as it is, and the kept turns only grow.
    grown = Session(
        system_prompt=SYSTEM,
        turns=[*SESSION.turns, turn(Role.USER, "And topic9 again?", "r10")],
        summary=summary,
        summarized_turns=covered,
    )
    second = truncate(grown, budget, SLIDING_SUMMARY, count_tokens)
    assert second.stored_summary is None
    assert second.summary == summary
    assert second.turns[: len(first.turns)] == first.turns


def test_key_sentences_keeps_what_later_turns_refer_to() -> None:
    old = [
        turn(Role.USER, "My cat Miso hates the vacuum. The weather is grey today.", "r0"),
        turn(Role.ASSISTANT, "Noted. Cats often fear loud machines.", "r0"),
    ]
    recent = [
        turn(Role.USER, "How do I get Miso used to the vacuum?", "r1"),
        turn(Role.ASSISTANT, "Run the vacuum far from Miso at first, then closer.", "r1"),
    ]
    session = Session(turns=old + recent)
    budget = Budget(cost(recent) + 30 * 4 // 3, OVERHEAD)
    cut = truncate(session, budget, KEY_SENTENCES, count_tokens)
    assert cut.turns == recent and cut.dropped == old
    assert "Miso hates the vacuum" in cut.summary
    assert "weather" not in cut.summary
    assert cut.dropped_sentences >= 1
    # Every left-out sentence, for a caller that knows the next message to choose again.
    assert [c.text for c in cut.candidates] == [
        "My cat Miso hates the vacuum.", "The weather is grey today.",
        "Noted.", "Cats often fear loud machines.",
    ]  # fmt: skip
    assert 0 < cut.excerpt_tokens < budget.tokens
    again = select(relevant_to(cut.candidates, "Will the weather stay grey?"), 30, count_tokens)
    assert again == ["The weather is grey today."]


def test_model_summary_asks_for_a_fold_before_the_turns_outgrow_their_room() -> None:
    """Before any summary: everything that fits is kept, and once the turns fill most of
    their room the reply asks the model to fold the oldest (into at most the summary's
    room), keeping enough recent turns whole that the next ones fit without folding."""
    budget = Budget(FULL + 10, OVERHEAD)
    cut = truncate(SESSION, budget, MODEL_SUMMARY, count_tokens)
    assert cut.turns == SESSION.turns and cut.summary == "" and not cut.dropped
    fold = cut.fold
    assert fold is not None and fold.covered == 0 and fold.summary == ""
    assert fold.turns == tuple(SESSION.turns[: fold.through]) and 0 < fold.through < 20
    room = budget.tokens - count_tokens(SYSTEM) - OVERHEAD
    assert fold.max_tokens == int(room * 0.25) - OVERHEAD
    assert cost(SESSION.turns[fold.through :]) <= (room - int(room * 0.25)) * 0.6
    small = Session(system_prompt=SYSTEM, turns=conversation(2))
    assert truncate(small, budget, MODEL_SUMMARY, count_tokens).fold is None


def test_model_summary_keeps_its_prefix_until_a_new_fold_is_stored() -> None:
    budget = Budget(FULL * 2 // 3, OVERHEAD)
    summary = "The user asked about topics 0 to 5."
    folded = Session(system_prompt=SYSTEM, turns=SESSION.turns, summary=summary,
                     summarized_turns=14)  # fmt: skip
    first = truncate(folded, budget, MODEL_SUMMARY, count_tokens)
    assert first.summary == summary and first.summarized_turns == 14
    assert first.turns == SESSION.turns[14:] and first.fold is None
    grown = Session(
        system_prompt=SYSTEM,
        turns=[*SESSION.turns, turn(Role.USER, "And topic9 again?", "r10")],
        summary=summary,
        summarized_turns=14,
    )
    second = truncate(grown, budget, MODEL_SUMMARY, count_tokens)
    assert second.summary == summary and second.turns[: len(first.turns)] == first.turns
    # Never folded (the model's summary did not come): what does not fit is left out.
    unfolded = truncate(SESSION, Budget(FULL // 3, OVERHEAD), MODEL_SUMMARY, count_tokens)
    assert unfolded.summary == "" and unfolded.dropped and unfolded.fold is not None
    assert unfolded.turns == SESSION.turns[len(unfolded.dropped) :]


def test_unknown_strategy_is_invalid() -> None:
    with pytest.raises(InvalidArgument, match="unknown strategy 'newest'"):
        truncate(SESSION, Budget(10), "newest", count_tokens)

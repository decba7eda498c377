"""The truncation evaluation's conversations and measures, on hand-made answers."""

from __future__ import annotations

import pytest

from bench.recall import (
    Fact,
    bleu4,
    conversation,
    conversations,
    normalize,
    obeyed,
    retained,
    rouge_l,
)
from bench.truncation import WHOLE, Answer, Row, StrategyRun, recommended, score
from llmmesh.types import Role


def test_conversations_are_the_same_for_a_seed_and_differ_across_seeds() -> None:
    assert conversations(5, seed=7) == conversations(5, seed=7)
    assert conversations(5, seed=7) != conversations(5, seed=8)
    assert conversation(3, seed=7) == conversations(5, seed=7)[3]


@pytest.mark.parametrize("index", range(20))
def test_facts_are_planted_early_then_buried_and_asked_at_the_end(index: int) -> None:
    talk = conversation(index, seed=1, filler_rounds=10)
    assert len(talk.turns) == 4 + 2 * 10
    assert [t.role for t in talk.turns[:2]] == [Role.USER, Role.ASSISTANT]
    early = " ".join(t.text for t in talk.turns[:4])
    later = " ".join(t.text for t in talk.turns[4:])
    assert len(talk.facts) == 2
    for fact in talk.facts:
        assert fact.answer in early and talk.turn_of(fact) in (0, 2)
        assert f" {normalize(fact.answer)} " not in f" {normalize(later)} "
    assert talk.marker in talk.system_prompt
    assert all(t.text.endswith(talk.marker) for t in talk.turns if t.role is Role.ASSISTANT)


def test_retention_is_the_fact_as_a_whole_word_after_normalisation() -> None:
    pet = Fact("I have a dog called Noodle.", "What is my dog called?", "Noodle")
    assert retained("Your dog is called noodle!", pet)
    assert retained("It's NOODLE, of course.", pet)
    assert not retained("Your dog is called Noodles.", pet)
    assert not retained("I don't know.", pet)
    code = Fact("My locker code is 4417.", "What is my locker code?", "4417")
    assert retained("The code is 4417.", code) and not retained("The code is 44170.", code)
    assert normalize("  Café,  São-Paulo! ") == "cafe sao paulo"


def test_the_instruction_is_kept_when_its_marker_word_is_there() -> None:
    assert obeyed("Paris is the capital. Cheers!", "Cheers")
    assert not obeyed("Paris is the capital.", "Cheers")
    assert not obeyed("Cheersful", "Cheers")


def test_rouge_l_and_bleu4_against_the_whole_historys_answer() -> None:
    reference = "Your dog is called Noodle and you live in Porto."
    assert rouge_l(reference, reference) == pytest.approx(1.0)
    assert bleu4(reference, reference) == pytest.approx(1.0)
    near = "Your dog is called Noodle and you live in Lisbon."
    far = "I am not sure what you mean."
    assert 0.5 < rouge_l(near, reference) < 1.0 and rouge_l(far, reference) < 0.2
    assert bleu4(far, reference) < bleu4(near, reference) < 1.0


def test_a_strategy_is_scored_against_the_reference_answers() -> None:
    def answer(text: str, kept: bool, prompt: int, cached: int) -> Answer:
        return Answer("c0", "What is my name?", text, kept, True, prompt, cached, 0.5, kept)

    whole = StrategyRun("whole", [answer("Your name is Ines.", True, 900, 0)])
    cut = StrategyRun("last_turns", [answer("I do not know.", False, 400, 100)])
    row = score(cut, whole)
    assert (row.retention, row.obeyed, row.prompt_tokens, row.cache_hit) == (0.0, 1.0, 400, 0.25)
    assert row.reached == 0.0 and score(whole, whole).reached == 1.0
    assert row.rouge_l < 0.5 and row.answers == 1
    assert score(whole, whole).rouge_l == pytest.approx(1.0)


def row(strategy: str, retention: float, prompt_tokens: float, answers: int = 100) -> Row:
    return Row(strategy, retention, 0.0, 0.0, 0.0, prompt_tokens, 0.0, 0.1, answers, 0.0, 0.0)


def test_the_default_retains_most_unless_a_cheaper_one_is_as_good_within_chance() -> None:
    whole = row(WHOLE, 0.5, 900)
    clear = [whole, row("model_summary", 0.30, 400), row("sliding_summary", 0.05, 250)]
    assert recommended(clear)[0].strategy == "model_summary"
    close = [whole, row("model_summary", 0.06, 400), row("sliding_summary", 0.03, 250)]
    chosen, why = recommended(close)
    assert chosen.strategy == "sliding_summary" and "within chance" in why

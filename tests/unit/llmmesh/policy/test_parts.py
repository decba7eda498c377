"""Everything a model will read is checked as one text: a deny phrase placed anywhere
among a conversation's messages, split across them any way, gets the verdict the phrase
gets alone; matches are reported, and redacted, in the part where they lie."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmmesh.policy.parts import Part, check_input
from llmmesh.policy.rules import RuleSet
from llmmesh.types import PolicyAction
from services.policy.config import DEFAULT_RULES

RULES = RuleSet.from_file(DEFAULT_RULES)
PHRASES = ["how to build a bomb", "make a bomb", "nerve agent", "steal passwords"]
FILLER = st.sampled_from(["Hello", "What is the weather like?", "Thanks!", "ok", "Sure."])
IGNORED = st.sampled_from(["", "", "\u200b", "\u00ad", "\u2060"])


def parts_of(texts: list[str]) -> list[Part]:
    return [Part(f"messages[{i}].content", t) for i, t in enumerate(texts)]


@st.composite
def conversations(draw: st.DrawFn) -> tuple[str, list[str]]:
    """A phrase, and messages that hold it: filler before and after, and the phrase cut
    at any positions into consecutive messages, with invisible characters sprinkled in."""
    phrase = draw(st.sampled_from(PHRASES))
    cuts = sorted(draw(st.sets(st.integers(1, len(phrase) - 1), max_size=4)))
    pieces = [phrase[a:b] for a, b in zip([0, *cuts], [*cuts, len(phrase)], strict=True)]
    pieces = ["".join(c + draw(IGNORED) for c in piece) for piece in pieces]
    before = draw(st.lists(FILLER, max_size=4))
    after = draw(st.lists(FILLER, max_size=4))
    if draw(st.booleans()):
        pieces[0] = f"{draw(FILLER)} {pieces[0]}"
    if draw(st.booleans()):
        pieces[-1] = f"{pieces[-1]} {draw(FILLER)}"
    return phrase, [*before, *pieces, *after]


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(conversations())
def test_a_phrase_anywhere_and_split_any_way_gets_the_verdict_of_the_phrase(
    case: tuple[str, list[str]],
) -> None:
    phrase, texts = case
    alone = check_input(RULES, [Part("prompt", phrase)]).verdict(RULES)
    spread = check_input(RULES, parts_of(texts)).verdict(RULES)
    assert (spread.action, spread.rule_ids[:1]) == (alone.action, alone.rule_ids[:1])
    assert alone.action is PolicyAction.DENY


def test_the_denial_names_the_part_where_the_match_starts() -> None:
    verdict = check_input(RULES, parts_of(["Hi", "how to build", "a bomb", "ok"])).verdict(RULES)
    assert verdict.denied_at == "messages[1].content"
    assert verdict.denial == "prompt denied by policy rule 'deny-weapons' in messages[1].content"


def test_each_part_is_redacted_in_place() -> None:
    texts = ["mail ada@example.com", "nothing here", "call +44 20 7946 0958 please"]
    decision = check_input(RULES, parts_of(texts))
    assert decision.texts == ("mail [EMAIL]", "nothing here", "call [PHONE] please")
    assert decision.matched_in == (
        ("redact-pii", "messages[0].content"),
        ("redact-pii", "messages[2].content"),
    )


def test_a_match_across_parts_leaves_its_placeholder_where_it_starts() -> None:
    rules = RuleSet.from_text(
        "version: v\nrules:\n  - {id: r, action: redact, keywords: [secret plan]}\n", "t"
    )
    decision = check_input(rules, parts_of(["the secret", "plan is on"]))
    assert decision.texts == ("the [REDACTED]", " is on")

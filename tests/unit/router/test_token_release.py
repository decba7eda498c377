"""Token entries under the streamed output check: released with their text, never ahead of
it, and never showing what a redaction replaced."""

from __future__ import annotations

from itertools import pairwise

from hypothesis import given, settings
from hypothesis import strategies as st

from llmmesh.policy.streaming import OutputScanner
from llmmesh.types import TokenLogprob
from services.router.token_release import REDACTED_TOKEN, GuardedTokens
from tests.unit.llmmesh.policy.test_streaming import RULES


def entries_of(tokens: list[str]) -> tuple[TokenLogprob, ...]:
    return tuple(
        TokenLogprob(i, text, -0.5, 1, ((i, text, -0.5), (999, "x@y.io", -3.0)))
        for i, text in enumerate(tokens)
    )


def run(chunks: list[list[str]]) -> tuple[str, list[TokenLogprob]]:
    """Streams ``chunks`` (each a list of token texts) through the check; returns the text
    it let out and the entries released, checking after every step that the entries so
    far spell no more than the text so far."""
    scanner, tokens = OutputScanner(RULES.output), GuardedTokens()
    shown, released = "", list[TokenLogprob]()
    for i, chunk in enumerate(chunks):
        final = i == len(chunks) - 1
        step = scanner.feed("".join(chunk))
        if final:
            step = step.then(scanner.finish())
        tokens.add("".join(chunk), entries_of(chunk))
        released += tokens.release(step.text, step.held)
        shown += step.text
        assert shown.startswith("".join(e.text for e in released)), (chunks, shown, released)
    return shown, released


def test_a_word_is_released_with_its_tokens_once_the_check_lets_it_out() -> None:
    scanner, tokens = OutputScanner(RULES.output), GuardedTokens()
    step = scanner.feed("Hello")
    tokens.add("Hello", entries_of(["Hel", "lo"]))
    assert tokens.release(step.text, step.held) == ()  # held: it may still grow
    step = scanner.feed(" wor")
    tokens.add(" wor", entries_of([" wor"]))
    assert [e.text for e in tokens.release(step.text, step.held)] == ["Hel", "lo"]


def test_a_redacted_address_is_one_entry_with_the_replacement() -> None:
    tokens = [" mail", " bob", "@", "example", ".com", " now", "."]
    shown, released = run([[t] for t in tokens])
    assert "bob@example.com" not in shown
    assert "".join(e.text for e in released) == shown
    merged = [e for e in released if e.token == REDACTED_TOKEN]
    assert len(merged) == 1 and merged[0].top == () and merged[0].logprob == -2.0
    assert all("bob" not in e.text and "example" not in e.text for e in released)
    assert [e.text for e in released[:1]] == [" mail"] and released[-1].text == "."


def test_tokens_that_split_a_character_go_out_with_the_chunk() -> None:
    tokens = GuardedTokens()
    tokens.add("é ok ", (TokenLogprob(1, "\ufffd", -1.0, 1), TokenLogprob(2, "\ufffd", -1.0, 1)))
    assert tokens.release("", 5) == ()
    assert [e.token for e in tokens.release("é ok ", 0)] == [1, 2]


def test_a_denied_stream_releases_nothing_it_held() -> None:
    tokens = GuardedTokens()
    tokens.add("the forbid", entries_of(["the", " forbid"]))
    assert [e.text for e in tokens.release("the", 7)] == ["the"]
    tokens.drop()
    tokens.add("den", entries_of(["den"]))
    assert tokens.release("", 3) == ()


WORDS = st.sampled_from(
    ["the", " cat", " sat", " on", " bob@example.com", " TICKET-12", " 555-0100", ",", " ",
     " code red", " secret plan", " x", "\n", " call +1 415 555 0123", " ab", "ion"]
)  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(st.lists(WORDS, min_size=1, max_size=12), st.data())
def test_entries_spell_what_the_check_let_out_and_hide_what_it_redacted(
    words: list[str], data: st.DataObject
) -> None:
    text = "".join(words)
    # Tokens: the text cut anywhere; chunks: runs of consecutive tokens.
    cuts = sorted(set(data.draw(st.lists(st.integers(1, max(len(text) - 1, 1)), max_size=20))))
    bounds = [0, *[c for c in cuts if 0 < c < len(text)], len(text)]
    pieces = [text[a:b] for a, b in pairwise(bounds)]
    sizes = data.draw(st.lists(st.integers(1, 4), min_size=len(pieces), max_size=len(pieces)))
    chunks, i = [], 0
    for size in sizes:
        if i < len(pieces):
            chunks.append(pieces[i : i + size])
            i += size
    shown, released = run(chunks)
    if shown == text:
        assert [e.text for e in released] == pieces
    for entry in released:
        if entry.token == REDACTED_TOKEN:
            assert entry.top == ()
        else:
            assert entry.text in text and entry.text in shown
    assert "".join(e.text for e in released) == shown

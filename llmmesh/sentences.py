"""Extractive summaries: sentences scored by how much later text refers to them (shared
content words) and by the names and numbers they carry; no model call. The context
service scores a session's sentences against its later turns; the router, which alone
knows the message about to be answered, scores them against it too (relevant_to)."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+|\n+")
_WORD = re.compile(r"[A-Za-z][A-Za-z'-]{2,}|\d[\d.,:/-]*")
_NAME = re.compile(r"\b[A-Z][a-z]+\b|\b\d[\d.,:/-]*")
_STOPWORDS = frozenset(
    """the and for are but not you your with this that have from they will would there
    their what about which when make can like time just him know take into year them some
    could then than other also its our after use two how first well way even new want
    because any these give day most was were has had been being did does doing here
    where who why all each few more such only own same too very should now she her his
    one out get got may might must shall yes let please thanks thank""".split()  # noqa: SIM905 (a paragraph of words reads better than a list)
)


def sentences(text: str) -> list[str]:
    return [s.strip() for s in _SENTENCE_END.split(text) if s.strip()]


def content_words(text: str) -> set[str]:
    return {w.lower() for w in _WORD.findall(text)} - _STOPWORDS


def named_entities(sentence: str) -> set[str]:
    """Capitalised words (but a sentence's first) and numbers."""
    return {
        m.group(0) for m in _NAME.finditer(sentence) if m.start() > 0 or m.group(0)[0].isdigit()
    }


@dataclass(frozen=True)
class Scored:
    order: int  # position in the conversation: kept sentences stay in order
    text: str
    score: float


def score(candidates: Sequence[str], later: Iterable[str]) -> list[Scored]:
    """Each candidate sentence's score: content words that ``later`` text shares with it,
    plus its names and numbers (what a conversation most often refers back to)."""
    reference: set[str] = set()
    for text in later:
        reference |= content_words(text)
    return [_scored(i, s, reference) for i, s in enumerate(candidates)]


def score_by_later_turns(turns: Sequence[str]) -> list[Scored]:
    """Every sentence of ``turns``, scored against the turns after its own."""
    later: list[set[str]] = [set() for _ in turns]
    seen: set[str] = set()
    for i in range(len(turns) - 1, -1, -1):
        later[i] = seen
        seen = seen | content_words(turns[i])
    ordered = [(s, later[i]) for i, turn in enumerate(turns) for s in sentences(turn)]
    return [_scored(n, s, reference) for n, (s, reference) in enumerate(ordered)]


def _scored(order: int, sentence: str, reference: set[str]) -> Scored:
    overlap = len(content_words(sentence) & reference)
    return Scored(order, sentence, overlap + 0.5 * len(named_entities(sentence)))


# A word the next message shares with a sentence weighs this many of the later turns':
# the message about to be answered is the later turn that matters most.
QUERY_WEIGHT = 4.0


def relevant_to(candidates: Sequence[Scored], message: str) -> list[Scored]:
    """``candidates`` scored again with the content words they share with ``message``."""
    words = content_words(message)
    return [
        replace(c, score=c.score + QUERY_WEIGHT * len(content_words(c.text) & words))
        for c in candidates
    ]


def select(scored: Sequence[Scored], budget_tokens: int, count: Callable[[str], int]) -> list[str]:
    """The best-scoring sentences that fit ``budget_tokens`` together (joined by spaces),
    in their order."""
    chosen: list[Scored] = []
    used = 0
    for candidate in sorted(scored, key=lambda c: (-c.score, c.order)):
        cost = count(candidate.text) + 1  # and a space between sentences
        if candidate.score <= 0 or used + cost > budget_tokens:
            continue
        chosen.append(candidate)
        used += cost
    return [c.text for c in sorted(chosen, key=lambda c: c.order)]

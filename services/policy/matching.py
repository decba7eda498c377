"""Matching a rule set against text in one pass per matcher kind, and knowing how much of
a growing text could still become a match (for the streamed output check).

Keywords of every rule share one Aho-Corasick automaton (case-folded, whitespace runs
collapsed, whole-word optional); regular expressions and detectors run on RE2, whose
matching time is linear in the text whatever the pattern.
"""

from __future__ import annotations

import bisect
import re
import re._parser as sre_parse  # type: ignore[import-not-found]  # widths of patterns
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import ahocorasick
import re2

from services.policy.detectors import DETECTORS, Detector
from services.policy.partial import prefix_pattern

_WHITESPACE_RUN = re.compile(r"\s{2,}|[^\S ]")
UNBOUNDED = 1 << 30


@dataclass(frozen=True)
class Hit:
    """A match of rule ``rule`` (its index in the set) at ``[start, end)``. A detector's
    pattern match that its validator refused is a hit with ``valid`` false: it finds
    nothing, but the pattern's scan moved past it. ``certain``: once the character after
    it is known, the whole text surely holds a match of this rule (false for detectors,
    where an overlapping match the validator refuses could be found instead)."""

    rule: int
    start: int
    end: int
    placeholder: str
    valid: bool = True
    certain: bool = True


@dataclass(frozen=True)
class RuleMatchers:
    """What one rule matches with (validated by the rule-set model)."""

    keywords: Sequence[str]
    whole_word: bool
    regex: Sequence[Any]  # compiled RE2 patterns
    detectors: Sequence[str]
    placeholder: str


class PatternError(ValueError):
    pass


def compile_regex(pattern: str) -> Any:
    """An RE2 pattern; unsupported syntax (backreferences, lookaround) and patterns that
    match the empty string are refused with the reason."""
    try:
        compiled = re2.compile(pattern)
    except re2.error as err:
        reason = err.args[0].decode() if err.args and isinstance(err.args[0], bytes) else err
        raise PatternError(f"regex {pattern!r} is not valid RE2 syntax: {reason}") from None
    if compiled.search("") is not None or _width(pattern)[0] == 0:
        raise PatternError(f"regex {pattern!r} matches the empty string")
    return compiled


def _width(pattern: str) -> tuple[int, int]:
    """(shortest, longest) match of a pattern in characters, UNBOUNDED when unlimited or
    when Python's parser does not know the RE2 syntax used."""
    try:
        low, high = sre_parse.parse(pattern).getwidth()
    except (re.error, OverflowError, RecursionError):
        return 1, UNBOUNDED
    return int(low), int(min(high, UNBOUNDED))


class _Folded:
    """Text lower-cased with whitespace runs collapsed to one space, and the way back from
    a folded position to a position in the original."""

    def __init__(self, text: str) -> None:
        lowered = text.lower()
        if len(lowered) != len(text):  # a few characters lower-case to two
            lowered = "".join(c if len(c.lower()) != 1 else c.lower() for c in text)
        self._runs: list[int] = []  # folded index of each collapsed run
        self._shift: list[int] = []  # characters removed up to and including that run
        parts, last, removed = [], 0, 0
        for run in _WHITESPACE_RUN.finditer(lowered):
            parts += [lowered[last : run.start()], " "]
            self._runs.append(run.start() - removed)
            removed += run.end() - run.start() - 1
            self._shift.append(removed)
            last = run.end()
        self.text = "".join([*parts, lowered[last:]]) if self._runs else lowered

    def origin(self, index: int) -> int:
        """The original position of folded character ``index``."""
        before = bisect.bisect_left(self._runs, index)  # runs strictly before index
        return index + (self._shift[before - 1] if before else 0)


def _is_word(char: str) -> bool:
    return char.isalnum() or char == "_"


class KeywordIndex:
    """All keywords of a rule set in one Aho-Corasick automaton."""

    def __init__(self, rules: Sequence[RuleMatchers]) -> None:
        self._automaton: Any = None
        self._prefixes: set[str] = set()
        self.longest = 0
        entries: dict[str, list[tuple[int, bool]]] = {}
        for index, rule in enumerate(rules):
            for keyword in rule.keywords:
                folded = " ".join(keyword.lower().split())
                entries.setdefault(folded, []).append((index, rule.whole_word))
        if not entries:
            return
        self._automaton = ahocorasick.Automaton()
        for folded, owners in entries.items():
            self._automaton.add_word(folded, (len(folded), tuple(owners)))
            self.longest = max(self.longest, len(folded))
            # A trailing piece of text that may yet become this keyword; a whole one too,
            # since the next character decides whether it stands as a whole word.
            self._prefixes.update(folded[:n] for n in range(1, len(folded) + 1))
        self._automaton.make_automaton()

    def hits(self, text: str, pos: int) -> list[Hit]:
        if self._automaton is None or pos >= len(text):
            return []
        # One character of context before ``pos`` decides whole-word matches there.
        base = max(pos - 1, 0)
        folded = _Folded(text[base:])
        found = []
        for last, (length, owners) in self._automaton.iter(folded.text):
            start = base + folded.origin(last - length + 1)
            end = base + folded.origin(last) + 1
            if start < pos:
                continue
            for rule, whole_word in owners:
                if not whole_word or _stands_alone(text, start, end):
                    found.append(Hit(rule, start, end, ""))
        return found

    def pending_start(self, text: str, pos: int) -> int | None:
        """Where the longest tail of ``text[pos:]`` that could still become a keyword
        starts, if any."""
        if self._automaton is None or pos >= len(text):
            return None
        folded = _Folded(text[pos:])
        for length in range(min(self.longest, len(folded.text)), 0, -1):
            if folded.text[-length:] in self._prefixes:
                return pos + folded.origin(len(folded.text) - length)
        return None


def _stands_alone(text: str, start: int, end: int) -> bool:
    before = start == 0 or not (_is_word(text[start]) and _is_word(text[start - 1]))
    after = end == len(text) or not (_is_word(text[end - 1]) and _is_word(text[end]))
    return before and after


@dataclass(frozen=True)
class _Pattern:
    rule: int
    compiled: Any
    placeholder: str
    valid: Callable[[str], bool] | None  # a detector's validator


class PatternIndex:
    """Regular expressions and detectors of a rule set."""

    def __init__(self, rules: Sequence[RuleMatchers], cap: int) -> None:
        self._patterns: list[_Pattern] = []
        regex_width = 0
        partials: list[str] = []
        for index, rule in enumerate(rules):
            for compiled in rule.regex:
                self._patterns.append(_Pattern(index, compiled, rule.placeholder, None))
                partial = _checked_prefix(compiled.pattern)
                if partial is None:
                    regex_width = max(regex_width, _width(compiled.pattern)[1])
                else:
                    partials.append(partial)
            for name in rule.detectors:
                detector: Detector = DETECTORS[name]
                self._patterns.append(
                    _Pattern(index, detector.pattern, detector.placeholder, detector.valid)
                )
                partials.append(detector.partial)
        # A tail of the text that a partial pattern matches may still grow into a match.
        # A regex without one (syntax Python's parser lacks) holds back its longest width
        # (and one character of context that decides a trailing \b).
        self.regex_holdback = min(regex_width + 1, cap) if regex_width else 0
        unique = sorted(set(partials))
        self._partial = re2.compile("|".join(f"(?:{p})\\z" for p in unique)) if unique else None

    def hits(self, text: str, pos: int) -> list[Hit]:
        return [
            Hit(
                p.rule,
                m.start(),
                m.end(),
                p.placeholder,
                p.valid is None or p.valid(m.group(0)),
                certain=p.valid is None,
            )
            for p in self._patterns
            for m in p.compiled.finditer(text, pos)
        ]

    def pending_start(self, text: str, pos: int) -> int | None:
        starts = []
        if self.regex_holdback:
            starts.append(max(len(text) - self.regex_holdback, pos))
        if self._partial is not None:
            tail = self._partial.search(text, pos)
            if tail is not None:
                starts.append(tail.start())
        return min(starts) if starts else None


def _checked_prefix(pattern: str) -> str | None:
    partial = prefix_pattern(pattern)
    if partial is None:
        return None
    try:
        re2.compile(partial)
    except re2.error:
        return None
    return partial


class Matcher:
    """One stage's rules (input or output) compiled for matching."""

    def __init__(self, rules: Sequence[RuleMatchers], holdback_cap: int) -> None:
        self._keywords = KeywordIndex(rules)
        self._patterns = PatternIndex(rules, holdback_cap)
        self.holdback_cap = holdback_cap

    def hits(self, text: str, pos: int = 0) -> list[Hit]:
        return self._keywords.hits(text, pos) + self._patterns.hits(text, pos)

    def settled_until(self, text: str, pos: int, hits: Sequence[Hit]) -> int:
        """How far ``text`` (of which ``[pos:]`` is new) is settled: no match can start
        before the returned position and reach beyond it, whatever text follows. Never
        holds back more than the cap, unless a complete match spans the cap's edge."""
        pending = [
            s
            for s in (
                self._keywords.pending_start(text, pos),
                self._patterns.pending_start(text, pos),
            )
            if s is not None
        ]
        settled = max(min(pending, default=len(text)), len(text) - self.holdback_cap, pos)
        # A match straddling the edge is held whole: cutting there would change what the
        # next scan finds.
        moved = True
        while moved:
            moved = False
            for hit in hits:
                if hit.start < settled < hit.end:
                    settled, moved = hit.start, True
        return settled

"""Matching a rule set against text in one pass per matcher kind, and knowing how much of
a growing text could still become a match (for the streamed output check).

Keywords of every rule share one Aho-Corasick automaton over the keyword view (whole-word
optional); regular expressions and detectors run on RE2 over the pattern view, whose
matching time is linear in the text whatever the pattern. Matches are reported in the
original text's positions.
"""

from __future__ import annotations

import re
import re._parser as sre_parse  # type: ignore[import-not-found]  # widths of patterns
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import ahocorasick
import numpy as np
import re2

from llmmesh.policy.detectors import DETECTORS, Detector
from llmmesh.policy.detectors import matches as detector_matches
from llmmesh.policy.escapes import Escapes, escape_start, escapes
from llmmesh.policy.normalize import (
    View,
    keyword_view,
    pattern_view,
    word_after,
    word_before,
    word_break,
)
from llmmesh.policy.partial import prefix_pattern

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
    """The view of rules that opt out of normalization: lower-cased, whitespace runs
    collapsed to one space."""

    @staticmethod
    def view(text: str) -> View:
        lowered = text.lower()
        if len(lowered) != len(text):  # a few characters lower-case to two
            lowered = "".join(c if len(c.lower()) != 1 else c.lower() for c in text)
        if not _WHITESPACE_RUN.search(lowered):
            return View(text, lowered, None)
        parts, origin, last = [], [], 0
        for run in _WHITESPACE_RUN.finditer(lowered):
            parts += [lowered[last : run.start()], " "]
            origin += [*range(last, run.start()), run.start()]
            last = run.end()
        parts.append(lowered[last:])
        origin += range(last, len(lowered))
        return View(text, "".join(parts), np.array(origin, dtype=np.int64))


class Views:
    """The views of one text, each made when a matcher first needs it."""

    def __init__(self, text: str) -> None:
        self.text = text
        self._made: dict[str, View] = {}
        self._escapes: Escapes | None = None

    def get(self, kind: str) -> View:
        view = self._made.get(kind)
        if view is None:
            view = self._made[kind] = _VIEWS[kind](self)
        return view

    @property
    def escapes(self) -> Escapes:
        """The text's escapes, looked for once for the views that read them."""
        if self._escapes is None:
            self._escapes = escapes(self.text)
        return self._escapes


_VIEWS: dict[str, Callable[[Views], View]] = {
    "keyword": lambda views: keyword_view(views.text, views.escapes),
    "folded": lambda views: _Folded.view(views.text),
    "pattern": lambda views: pattern_view(views.text, views.escapes),
    "raw": lambda views: View(views.text, views.text, None),
}


class KeywordIndex:
    """All keywords of a rule set in one Aho-Corasick automaton over one view: the keyword
    view (``normalized``), or the folded one for rules that opt out."""

    def __init__(self, rules: Sequence[tuple[int, RuleMatchers]], normalized: bool) -> None:
        self._kind = "keyword" if normalized else "folded"
        self._automaton: Any = None
        self._prefixes: set[str] = set()
        self.longest = 0
        entries: dict[str, list[tuple[int, bool]]] = {}
        for index, rule in rules:
            for keyword in rule.keywords:
                key = _keyword_key(self._kind, keyword)
                entries.setdefault(key, []).append((index, rule.whole_word))
        if not entries:
            return
        self._automaton = ahocorasick.Automaton()
        for key, owners in entries.items():
            self._automaton.add_word(key, (len(key), tuple(owners)))
            self.longest = max(self.longest, len(key))
            # A trailing piece of text that may yet become this keyword; a whole one too,
            # since the next character decides whether it stands as a whole word.
            self._prefixes.update(key[:n] for n in range(1, len(key) + 1))
        self._automaton.make_automaton()

    def __bool__(self) -> bool:
        return self._automaton is not None

    def hits(self, views: Views, pos: int) -> list[Hit]:
        text = views.text
        if self._automaton is None or pos >= len(text):
            return []
        view = views.get(self._kind)
        found = []
        # Where an escape still being written ends what is known of the text.
        tail = escape_start(text) if self._kind == "keyword" else None
        for last, (length, owners) in self._automaton.iter(view.text, view.position(pos)):
            first = last - length + 1
            start, end = view.start(first), view.end(last + 1)
            for rule, whole_word in owners:
                if not whole_word:
                    found.append(Hit(rule, start, end, ""))
                    continue
                alone, known = _stands_alone(view, start, view.start(last), end, tail)
                if alone:
                    found.append(Hit(rule, start, end, "", certain=known))
        return found

    def spanning(self, views: Views, join: int) -> list[Hit]:
        """Every match that contains the text's position ``join`` (the automaton finds
        overlapping matches)."""
        return [hit for hit in self.hits(views, 0) if hit.start < join < hit.end]

    def pending_start(self, views: Views, pos: int) -> int | None:
        """Where the longest tail of ``text[pos:]`` that could still become a keyword
        starts, if any."""
        if self._automaton is None or pos >= len(views.text):
            return None
        view = views.get(self._kind)
        size = len(view.text)
        for length in range(min(self.longest, size - view.position(pos)), 0, -1):
            if view.text[-length:] in self._prefixes:
                return view.start(size - length)
        return None


def _keyword_key(kind: str, keyword: str) -> str:
    """What a keyword matches in its view; refused when that leaves nothing, or one
    character of a keyword written with more (``c++`` would match every word "c")."""
    written = keyword.strip()
    key = Views(written).get(kind).text
    if not key:
        raise PatternError(f"keyword {keyword!r} has no letter or digit to match")
    if len(key) == 1 and len(written) > 1:
        raise PatternError(
            f"keyword {keyword!r} reads as {key!r} (punctuation and symbols separate a"
            " keyword's letters): write it as a regex, or set normalize: false"
        )
    return key


def _stands_alone(
    view: View, start: int, last: int, end: int, tail: int | None
) -> tuple[bool, bool]:
    """Whether a keyword match of the view's original ``[start:end]`` (its last letter at
    ``last``) stands as a whole word, and whether that is known yet (the text may grow past
    ``end``, or an escape still being written at ``tail`` may read as a letter). An escape
    is read as the characters it stands for."""
    text, escapes = view.original, view.escapes
    before_char = word_before(text, start, view)
    # (An escape that stands for nothing begins or ends no match: it has no view text.)
    first_char = escapes[start][1][0] if start in escapes else text[start]
    before = before_char is None or word_break(before_char, first_char)
    after_char, known = word_after(text, end, escapes, tail)
    last_char = escapes[last][1][-1] if last in escapes else text[last]
    after = after_char is None or word_break(last_char, after_char)
    return before and after, known


@dataclass(frozen=True)
class _Pattern:
    rule: int
    compiled: Any
    placeholder: str
    detector: Detector | None  # None: a regex rule's


class PatternIndex:
    """Regular expressions and detectors of a rule set, over one view: the pattern view
    (``normalized``), or the text itself for rules that opt out."""

    def __init__(
        self, rules: Sequence[tuple[int, RuleMatchers]], cap: int, normalized: bool
    ) -> None:
        self._kind = "pattern" if normalized else "raw"
        self._patterns: list[_Pattern] = []
        regex_width = 0
        partials: list[str] = []
        for index, rule in rules:
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
                    _Pattern(index, detector.pattern, detector.placeholder, detector)
                )
                if detector.partial is None:
                    regex_width = max(regex_width, _width(detector.pattern.pattern)[1])
                else:
                    partials.append(detector.partial)
        # A tail of the text that a partial pattern matches may still grow into a match.
        # A regex without one (syntax Python's parser lacks) holds back its longest width
        # (and one character of context that decides a trailing \b).
        self.regex_holdback = min(regex_width + 1, cap) if regex_width else 0
        unique = sorted(set(partials))
        self._partial = re2.compile("|".join(f"(?:{p})\\z" for p in unique)) if unique else None
        self._any = _pattern_set([p.compiled.pattern for p in self._patterns])

    def __bool__(self) -> bool:
        return bool(self._patterns)

    def hits(self, views: Views, pos: int) -> list[Hit]:
        view = views.get(self._kind)
        at = view.position(pos)
        return [hit for p in self._matching(view) for hit in _pattern_hits(p, view, at)]

    def spanning(self, views: Views, join: int) -> list[Hit]:
        """Every match that contains the text's position ``join``, overlapping ones too:
        finditer's matches do not overlap, so one that ends before ``join`` would hide one
        that begins inside it and goes on past ``join``."""
        view = views.get(self._kind)
        found = []
        for pattern in self._matching(view):
            start = 0
            while (m := pattern.compiled.search(view.text, start)) is not None:
                accepted = pattern.detector is None or pattern.detector.accepts(m.group(0))
                hit = _pattern_hit(pattern, m.start(), m.end(), view, valid=accepted)
                if hit.start >= join:
                    break
                if hit.end > join:
                    found.append(hit)
                start = m.start() + 1
        return found

    def _matching(self, view: View) -> list[_Pattern]:
        """The patterns that match the view somewhere: one pass over it says which, and
        only those are run."""
        if self._any is None:
            return self._patterns
        matching = self._any.Match(view.text)  # None when none does
        return [self._patterns[i] for i in sorted(matching)] if matching is not None else []

    def pending_start(self, views: Views, pos: int) -> int | None:
        if not self._patterns:
            return None
        view = views.get(self._kind)
        at = view.position(pos)
        start = max(len(view.text) - self.regex_holdback, at) if self.regex_holdback else None
        if self._partial is not None:
            tail = _search(self._partial, view.text, at)
            if tail is not None and (start is None or tail < start):
                start = tail
        return None if start is None else view.start(start)  # start() keeps the order


def _pattern_hits(pattern: _Pattern, view: View, at: int) -> Iterator[Hit]:
    """The pattern's matches in the view from ``at``; a detector's, each with whether it
    is the thing (one that is not hides nothing)."""
    if pattern.detector is None:
        for match in pattern.compiled.finditer(view.text, at):
            yield _pattern_hit(pattern, match.start(), match.end(), view, valid=True)
        return
    for start, end, accepted in detector_matches(pattern.detector, view.text, at):
        yield _pattern_hit(pattern, start, end, view, valid=accepted)


def _pattern_hit(pattern: _Pattern, start: int, end: int, view: View, valid: bool) -> Hit:
    """A match of the view's ``[start:end]``, as a hit on the text."""
    certain = pattern.detector is None
    shown = view.start(start), view.end(end)
    return Hit(pattern.rule, *shown, pattern.placeholder, valid, certain=certain)


def _search(compiled: Any, text: str, pos: int) -> int | None:
    """Where ``compiled`` first matches ``text`` from ``pos``. ASCII text goes to RE2 as
    bytes, where positions are the same: the wrapper's mapping of positions in str takes
    twice as long as the search itself on a streamed chunk's few characters."""
    found = compiled.search(text.encode("ascii") if text.isascii() else text, pos)
    return None if found is None else int(found.start())


def _pattern_set(patterns: Sequence[str]) -> Any:
    """All of a rule set's patterns in one RE2 set (a single scan of the text says which
    of them match anywhere), or None when RE2 cannot build it."""
    if not patterns:
        return None
    any_of = re2.Set.SearchSet()
    try:
        for pattern in patterns:
            any_of.Add(pattern)
        any_of.Compile()
    except re2.error:
        return None
    return any_of


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
    """One stage's rules (input or output) compiled for matching. Rules match on the
    normalized views of the text (llmmesh/policy/normalize.py) unless they opt out."""

    def __init__(
        self, rules: Sequence[RuleMatchers], holdback_cap: int, normalized: Sequence[bool]
    ) -> None:
        by_view: dict[bool, list[tuple[int, RuleMatchers]]] = {True: [], False: []}
        for index, (rule, normalize) in enumerate(zip(rules, normalized, strict=True)):
            by_view[normalize].append((index, rule))
        self._indexes: list[KeywordIndex | PatternIndex] = []
        for normalize, owned in by_view.items():
            if owned:
                keywords = KeywordIndex(owned, normalize)
                patterns = PatternIndex(owned, holdback_cap, normalize)
                # Only indexes with something to match: each costs a call per chunk.
                self._indexes += [i for i in (keywords, patterns) if i]
        self.holdback_cap = holdback_cap
        # The normalized views read escapes (llmmesh/policy/escapes.py): a stream's tail
        # that may yet become one waits for the characters that say which.
        self._reads_escapes = any(normalized)

    def hits(self, text: str | Views, pos: int = 0) -> list[Hit]:
        views = text if isinstance(text, Views) else Views(text)
        return [hit for index in self._indexes for hit in index.hits(views, pos)]

    def spanning(self, views: Views, join: int) -> list[Hit]:
        """The matches that begin before ``join`` and end after it, each found even where a
        match of the text before ``join`` overlaps it."""
        return [hit for index in self._indexes for hit in index.spanning(views, join)]

    def read_until(self, text: str) -> int:
        """How much of ``text`` reads as it will whatever follows: all of it, but for an
        escape still being written at its end."""
        escape = escape_start(text) if self._reads_escapes else None
        return len(text) if escape is None else escape

    def settled_until(self, text: str | Views, pos: int, hits: Sequence[Hit]) -> int:
        """How far ``text`` (of which ``[pos:]`` is new) is settled: no match can start
        before the returned position and reach beyond it, whatever text follows. Never
        holds back more than the cap, unless a complete match spans the cap's edge."""
        views = text if isinstance(text, Views) else Views(text)
        size = len(views.text)
        settled = size
        escape = escape_start(views.text) if self._reads_escapes else None
        if escape is not None:
            # An escape still being written: what precedes it may grow into a match
            # through the character it turns out to be, as if the text ended there.
            settled, views = escape, Views(views.text[:escape])
        for index in self._indexes:
            start = index.pending_start(views, pos)
            if start is not None and start < settled:
                settled = start
        return held_whole(max(settled, size - self.holdback_cap, pos), hits)


def held_whole(settled: int, hits: Sequence[Hit]) -> int:
    """``settled``, moved back before any of ``hits`` that straddles it: cutting a match
    would change what the next scan finds."""
    moved = True
    while moved:
        moved = False
        for hit in hits:
            if hit.start < settled < hit.end:
                settled, moved = hit.start, True
    return settled

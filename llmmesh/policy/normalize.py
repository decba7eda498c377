"""What matching sees of a text: views that survive the usual evasions, and the way back
from a position in a view to the original characters.

Each view maps every original character on its own to zero or more characters (an escape
that stands for a character, read whole, is the one exception: below), so the view of a
concatenation is the concatenation of the views (the streamed output check relies on it),
and a match in the view maps back to a span of the original:

- the **pattern view** (regular expressions and detectors): compatibility forms folded
  (Unicode NFKC: fullwidth letters and digits, no-break spaces, ligatures; and the
  ideographic full stop read as a dot, as domain names read it), symbols that draw a
  Latin letter read as it (a negative squared B, a regional indicator), tag
  characters read as the ASCII they mirror (text hidden in them), other format
  characters (zero-width space and joiners, soft hyphen) and combining marks removed,
  and every other non-ASCII character replaced by its confusable skeleton (Unicode's
  UTS #39 data, through ICU), so Cyrillic a (U+0430) reads as Latin a; every script's
  decimal digits read as ASCII digits (Arabic-Indic, Devanagari). Case is kept: a pattern
  says itself whether case matters.
- the **keyword view**: the pattern view case-folded, with separators removed
  (whitespace, control, private-use and unassigned characters, and every punctuation mark
  and symbol but the two below), so "b-o-m-b", "b o m b", "b/o/m/b" and a quoted "bomb"
  all read "bomb"; and digits and signs that stand for letters read as those letters
  (0 o, 1 i, 3 e, 4 a, 5 s, 7 t, @ a, $ s: "b0mb"), with l read as i, since 1 and a
  capital I stand for either ("bui1d", "buiId"). A keyword is compared in its own
  keyword view.

Both views read escapes (HTML character references, URL percent-escapes, backslash
escapes: llmmesh/policy/escapes.py) as the characters they stand for, then fold those: a
model reads "&#98;omb", "%62omb" and "\\u0062omb" as the word they spell, and a client's
page shows "ada&#64;example.com" as an address. An escape is read whole, so a match that
takes its character takes all of it; a stream's tail that more text could make into one
waits for that text (``escape_start``), and so does what precedes it.

ASCII characters are their own skeleton: mapping ASCII to ASCII ("1" to "l", "m" to
"rn", as the skeleton does) would make ordinary text match keywords it does not contain
and break digit patterns such as card numbers.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Callable
from functools import partial
from typing import Any

import icu
import numpy as np
import numpy.typing as npt

from llmmesh.policy.escapes import Escapes, escapes

_IGNORED_CATEGORIES = frozenset({"Cf", "Mn", "Me"})  # format characters, combining marks
# What a keyword's letters may be spaced or wrapped with and still read as the keyword:
# spaces, control, private-use and unassigned characters, punctuation and symbols
# (b/o/m/b, "bomb", (bomb)).
_SEPARATOR_CATEGORIES = frozenset(
    {"Zs", "Zl", "Zp", "Cc", "Co", "Cn", "Pc", "Pd", "Ps", "Pe", "Pi", "Pf", "Po"}
    | {"Sm", "Sc", "Sk", "So"}
)
# A whole-word check looks past at most this many ignored characters on either side (and
# the streamed check keeps as much released text as context), so that checking a stream
# piece by piece sees what checking it whole sees.
MAX_IGNORED_RUN = 32

# Digits and signs written for the letters they look like ("b0mb", "pa$$w0rd"): the
# keyword view reads them as those letters (a keyword's own are read the same way). A 1,
# and a capital I, are written for an l as often as for an i ("bui1d", "ki11", "buiId"),
# so l and i read as one letter.
_LOOKALIKE_DIGITS, _LETTERS = "013457@$l", "oieastasi"
_LOOKALIKE_SIGNS = frozenset("@$")
_ASCII_SEPARATOR_BYTES = bytes(
    code for code in range(128) if not chr(code).isalnum() and chr(code) not in _LOOKALIKE_SIGNS
)
_ASCII_SEPARATOR = np.zeros(128, dtype=bool)
_ASCII_SEPARATOR[list(_ASCII_SEPARATOR_BYTES)] = True
_LOOKALIKES = str.maketrans(_LOOKALIKE_DIGITS, _LETTERS)
_ASCII_LOOKALIKES = bytes.maketrans(_LOOKALIKE_DIGITS.encode(), _LETTERS.encode())

_SPOOF: Any = icu.SpoofChecker()
# The ideographic full stops, which domain names read as dots (IDNA's mapping, UTS #46):
# "ada@example\u3002com" is an address to a mail client and to a model.
_FULL_STOPS = str.maketrans({"\u3002": ".", "\uff61": "."})
# Symbols that draw a Latin letter: the negative circled and squared letters (U+1F150,
# U+1F170: "\U0001f171omb") and the regional indicators (U+1F1E6: two of them show as a
# flag, one as its letter), which a model reads as letters.
_DRAWN_LETTER = re.compile(
    r"(?:LATIN (CAPITAL|SMALL) LETTER|REGIONAL INDICATOR SYMBOL LETTER) ([A-Z])$"
)

# Unicode's tag characters U+E0020-U+E007E mirror printable ASCII and show as nothing:
# text written in them is invisible to whoever reads the prompt, yet a model whose
# tokenizer keeps them can read it ("ASCII smuggling"). The views read each as the ASCII
# character it mirrors; the other tags (language tag, cancel tag) are format characters.
_TAG_OFFSET = 0xE0000
_ASCII_TAGS = range(_TAG_OFFSET + 0x20, _TAG_OFFSET + 0x7F)


def ignored(char: str) -> bool:
    """A character no view shows: a format character or a combining mark (a tag
    character that mirrors ASCII shows as that character)."""
    if char.isascii() or ord(char) in _ASCII_TAGS:
        return False
    return unicodedata.category(char) in _IGNORED_CATEGORIES


def _strip_marks(text: str) -> str:
    decomposed = unicodedata.normalize("NFD", text)
    kept = "".join(c for c in decomposed if unicodedata.category(c) not in _IGNORED_CATEGORIES)
    return unicodedata.normalize("NFC", kept)


def pattern_char(char: str) -> str:
    """One character as the pattern view shows it."""
    if char.isascii():
        return char
    if ord(char) in _ASCII_TAGS:
        return chr(ord(char) - _TAG_OFFSET)
    if unicodedata.category(char) in _IGNORED_CATEGORIES:
        return ""
    digit = unicodedata.decimal(char, None)
    if digit is not None:  # any script's digit: a card in Arabic-Indic digits is a card
        return str(digit)
    folded = _strip_marks(unicodedata.normalize("NFKC", char)).translate(_FULL_STOPS)
    if folded.isascii():
        return folded
    drawn = _drawn_letter(char)
    if drawn is not None:
        return drawn
    skeleton = "".join(c if c.isascii() else _SPOOF.getSkeleton(0, c) for c in folded)
    return _strip_marks(skeleton)


def _drawn_letter(char: str) -> str | None:
    """The Latin letter a symbol draws, when its name says so (no compatibility form or
    confusable maps these to it)."""
    if unicodedata.category(char) != "So":
        return None
    named = _DRAWN_LETTER.search(unicodedata.name(char, ""))
    if named is None:
        return None
    return named[2].lower() if named[1] == "SMALL" else named[2]


def _is_separator(char: str) -> bool:
    if char in _LOOKALIKE_SIGNS:
        return False
    return unicodedata.category(char) in _SEPARATOR_CATEGORIES


def keyword_char(char: str) -> str:
    """One character as the keyword view shows it."""
    if char.isascii():
        return "" if _ASCII_SEPARATOR[ord(char)] else char.lower().translate(_LOOKALIKES)
    # Folded first: a symbol may be a letter in disguise (circled and other letter-like
    # symbols fold to their letter), and a fullwidth sign to a look-alike one.
    folded = pattern_char(char).casefold()
    kept = "".join(c for c in _strip_marks(folded) if not _is_separator(c))
    return kept.translate(_LOOKALIKES)


Origin = npt.NDArray[np.int64]


class View:
    """A view of ``original``: its text, and where each of its characters came from."""

    __slots__ = ("_by_end", "_origin", "_origin_of", "escapes", "original", "text")

    def __init__(
        self,
        original: str,
        text: str,
        origin: Origin | None,
        origin_of: Callable[[], Origin] | None = None,
        escapes: Escapes | None = None,
    ) -> None:
        """``origin``: the original index of each view character (None: the same); or
        ``origin_of`` works it out when a position is first mapped (most texts match
        nothing, and need none). ``escapes``: the escapes read as their characters, by
        where each starts (their characters' origin)."""
        self.original = original
        self.text = text
        self._origin = origin
        self._origin_of = origin_of
        self.escapes = escapes or {}
        self._by_end: dict[int, int] | None = None

    @property
    def escape_starts(self) -> dict[int, int]:
        """Where each escape starts, by where it ends (made once: every whole-word check
        of the text reads it)."""
        if self._by_end is None:
            self._by_end = {end: start for start, (end, _) in self.escapes.items()}
        return self._by_end

    def _map(self) -> Origin | None:
        if self._origin_of is not None:
            self._origin, self._origin_of = self._origin_of(), None
        return self._origin

    def start(self, index: int) -> int:
        """The original position of the view character at ``index``."""
        origin = self._map()
        if origin is None:
            return index
        return int(origin[index]) if index < len(self.text) else len(self.original)

    def end(self, index: int) -> int:
        """The original end of a match that ends before view position ``index``: past the
        character that produced the view's character ``index - 1`` and any ignored
        characters (combining marks) that follow it."""
        origin = self._map()
        if origin is None:
            return index
        last = int(origin[index - 1])
        escape = self.escapes.get(last)
        end = escape[0] if escape else last + 1
        original = self.original
        while end < len(original) and ignored(original[end]):
            end += 1
        return end

    def position(self, original_index: int) -> int:
        """The view position of the original position ``original_index``."""
        if original_index == 0:  # a text's start is its views' start
            return 0
        origin = self._map()
        if origin is None:
            return original_index
        return int(np.searchsorted(origin, original_index))


_TABLE_LIMIT = 1 << 16


class _Table(dict[str, str]):
    """A per-character mapping filled on first use: a lookup, not a call, per character."""

    def __init__(self, mapping: Callable[[str], str]) -> None:
        super().__init__()
        self._mapping = mapping

    def __missing__(self, char: str) -> str:
        if len(self) >= _TABLE_LIMIT:  # bounded, whatever mix of characters arrives
            self.clear()
        mapped = self[char] = self._mapping(char)
        return mapped


_PATTERN = _Table(pattern_char)
_KEYWORD = _Table(keyword_char)


def _mapped(text: str, table: _Table, found: Escapes) -> View:
    """``text`` through ``table``, each escape of ``found`` read as its characters through
    the table, all of them from its first."""
    pieces = list(map(table.__getitem__, text))
    for start, (end, decoded) in found.items():
        pieces[start] = "".join(map(table.__getitem__, decoded))
        pieces[start + 1 : end] = [""] * (end - start - 1)
    lengths = np.fromiter(map(len, pieces), dtype=np.int64, count=len(pieces))
    origin = np.repeat(np.arange(len(text), dtype=np.int64), lengths)
    return View(text, "".join(pieces), origin, escapes=found)


def pattern_view(text: str, found: Escapes | None = None) -> View:
    """``found``: the text's escapes, when already looked for."""
    found = escapes(text) if found is None else found
    if text.isascii() and not found:
        return View(text, text, None)
    return _mapped(text, _PATTERN, found)


def keyword_view(text: str, found: Escapes | None = None) -> View:
    """``found``: the text's escapes, when already looked for."""
    found = escapes(text) if found is None else found
    if found:
        return _mapped(text, _KEYWORD, found)
    if text.isascii():
        # Byte operations only: a prompt's check often runs with cold caches, where each
        # library touched costs far more than its work.
        lowered = text.lower().encode("ascii")
        kept = lowered.translate(_ASCII_LOOKALIKES, _ASCII_SEPARATOR_BYTES).decode("ascii")
        if len(kept) == len(text):
            return View(text, kept, None)
        return View(text, kept, None, partial(_ascii_kept, lowered))
    return _mapped(text, _KEYWORD, {})


def _ascii_kept(lowered: bytes) -> Origin:
    """The original index of each character an ASCII keyword view keeps."""
    return np.flatnonzero(~_ASCII_SEPARATOR[np.frombuffer(lowered, dtype=np.uint8)])


def word_break(left: str, right: str) -> bool:
    """Whether a word ends between two adjacent characters, as a reader sees it: unless
    both are letters or digits, and between a lower-case letter and an upper-case one
    (``how_to_build_a_bomb`` and ``howToBuildABomb`` are words apart to a model)."""
    return not (left.isalnum() and right.isalnum()) or (left.islower() and right.isupper())


def word_before(text: str, index: int, view: View | None = None) -> str | None:
    """The character a whole-word check sees before ``index`` (ignored characters
    skipped; an escape the ``view`` of ``text`` reads as the last character it stands
    for), or None at the start of the text."""
    found = view.escapes if view is not None else {}
    starts = view.escape_starts if view is not None and found else {}
    stop = max(index - MAX_IGNORED_RUN - 2, -1)
    i = index - 1
    while i > stop:
        start = starts.get(i + 1)
        char = text[i] if start is None else found[start][1][-1:]
        if char and not ignored(char):  # an escape may stand for nothing (&#1;)
            return char
        i = i - 1 if start is None else start - 1
    return None


def word_after(
    text: str, index: int, found: Escapes | None = None, tail: int | None = None
) -> tuple[str | None, bool]:
    """The character a whole-word check sees at or after ``index`` (ignored characters
    skipped; an escape of ``found`` as the first character it stands for), or None; and
    whether that is known (false when the text ends within the run of ignored characters
    it may skip, or reaches ``tail``, an escape still being written: more text could
    still follow)."""
    limit = min(index + MAX_IGNORED_RUN + 1, len(text))
    i = index
    while i < limit:
        if tail is not None and i >= tail:
            return None, False
        escape = found.get(i) if found else None
        char = text[i] if escape is None else escape[1][:1]
        if char and not ignored(char):  # an escape may stand for nothing (&#1;)
            return char, True
        i = i + 1 if escape is None else escape[0]
    return None, len(text) >= index + MAX_IGNORED_RUN + 1

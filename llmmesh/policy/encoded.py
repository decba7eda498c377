"""Text a model reads through an encoding of a whole string: base64 (standard or URL-safe)
and hexadecimal. Unlike an escape (llmmesh/policy/escapes.py), such a string has no
character that stands for one character of what it says, so a match in what it decodes to
is a match of the whole string: a deny rule denies, a redaction replaces all of it.

A string is found written whole (a run of 12 characters or more) or broken into pieces
that are read back together: hexadecimal bytes one by one or in groups (``68 6f 77``,
``0x68, 0x6f``), and base64 in pieces of one length (a MIME body's lines, ``aG93IHRv
IGJ1aWxk``), either in a list's quotes and commas too. What it decodes to is read where it
is text (UTF-8, or UTF-16 where many of its bytes are NUL: llmmesh/policy/bytes_text.py),
8 bytes of it or more: a hash, a key or a word that happens to be valid base64 mostly
decodes to bytes that are not text (and the rare stretch that reads as text is gibberish
that no rule matches). Characters put before the encoded text, among it or after it do not
hide it: each place its groups may begin is tried, and every stretch of text kept. Text
that is encoded again is read through each encoding (MAX_ENCODINGS). Only in what a model
will read (the input check): the streamed output is checked as written.
"""

from __future__ import annotations

import binascii
import re
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import NamedTuple

import re2

from llmmesh.policy.bytes_text import MIN_TEXT, Decoding, read_text
from llmmesh.policy.joined import SEPARATOR, Joined
from llmmesh.policy.matching import Hit, Matcher, Views

# Text encoded again and again (base64 of base64, hexadecimal of base64) is read through
# each encoding, as a model that decodes once decodes again, up to this many: each one
# makes the text a third longer at least, and reading it costs what it decodes to.
MAX_ENCODINGS = 4
# A run long enough to hide a phrase (9 bytes of base64, "bioweapon"; 6 of hexadecimal,
# below MIN_TEXT). One scan for both alphabets: hexadecimal digits are base64 characters
# too, and a run of them is read both ways.
_MIN_RUN = 12
_BASE64 = "A-Za-z0-9+/_-"
# Every pattern is ASCII, and is looked for by RE2 (a few microseconds a kilobyte, where
# Python's engine tries each place a match may start) in the text's bytes with one byte a
# character (anything not ASCII a "?"), so that a match's positions are the text's.
_RUN = re2.compile(f"[{_BASE64}]{{{_MIN_RUN},}}={{0,2}}".encode("ascii"))
_HEX_RUN = re.compile(f"[0-9A-Fa-f]{{{_MIN_RUN},}}".encode("ascii"))
# Hexadecimal written apart: four pieces or more of two digits or more (each a word), with
# or without 0x, between spaces, commas, colons, dots, dashes or a list's quotes.
_HEX_PIECES = re2.compile(
    rb"\b(?:0[xX])?[0-9A-Fa-f]{2,}(?:[\s,:;.'\"-]{1,4}(?:0[xX])?[0-9A-Fa-f]{2,}){3,}"
    rb"(?:[\s,:;.'\"-]{1,4}(?:0[xX])?[0-9A-Fa-f])?"  # and the last digit of an odd number
)
_HEX_PIECE = re.compile(rb"(?:0[xX])?([0-9A-Fa-f]+)")
_MIN_HEX_DIGITS = 2 * MIN_TEXT
# Base64 written apart: pieces between white space (or a list's commas and quotes), two
# of them side by side with an upper-case letter, a digit, "+" or "/" past their first
# character, as base64's pieces of text have (every piece of 8 characters or more, 98% of
# those of 4) and few words do.
_PIECE = f"[{_BASE64}]+"
_APART = "[\\s,;|'\"]+"  # white space, or a list's commas and quotes
_MARKED = "[A-Z0-9+/]"
_MARKED_PIECE = (  # four characters or more, one of them marked past the first
    f"[{_BASE64}](?:{_MARKED}[{_BASE64}]{{2,}}|[{_BASE64}]{_MARKED}[{_BASE64}]+"
    f"|[{_BASE64}]{{2,}}{_MARKED}[{_BASE64}]*)"
)
_BASE64_PIECES = re2.compile(
    (
        f"(?:{_PIECE}{_APART})*{_MARKED_PIECE}{_APART}{_MARKED_PIECE}(?:{_APART}{_PIECE})*"
        f"(?:(?:{_APART})?=){{0,2}}"  # the padding, apart or not
    ).encode("ascii")
)
_BASE64_PIECE = re.compile(f"[={_BASE64}]+".encode("ascii"))
_URL_SAFE = bytes.maketrans(b"-_", b"+/")
# A run without an upper-case letter or a digit (a snake_case name, a path) is left alone:
# the base64 of text always has one, save a text made for it (every third of its
# characters one of "jknorsvwz{~"), and the hexadecimal of text always has digits.
_UPPER_OR_DIGIT = re.compile(b"[A-Z0-9]")
# _DIGITS_ONLY: digits alone (a long number, a table's row of numbers) are not read as
# base64. Their values (52-61) each set two bits of every byte they decode to, so none is
# NUL (no UTF-16), every third is a lead byte of 0xD3 or more, and what reads as UTF-8 is
# letters of Hebrew, Arabic, NKo and CJK among ASCII pairs such as "mv" or "}6": no
# phrase, and reading it took most of the check of a table of numbers.
# How many characters of an unfinished last group of four are read: 2 or 3 are a byte or
# two; a lone one is none.
_LAST_GROUP = (0, 0, 2, 3)
# ASCII that is not text (but line breaks and the tab): decoded bytes without any read whole.
_CONTROL = re.compile(rb"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")


class Decoded(NamedTuple):
    """A run of ``text[start:end]`` and the text it decodes to."""

    start: int
    end: int
    text: str


Span = tuple[int, int]


def decoded_runs(text: str, encodings: int = MAX_ENCODINGS) -> list[Decoded]:
    """The runs of ``text`` that decode, as base64 or hexadecimal, to readable text, whole
    or in pieces, in the order they begin (a run read whole may lie in a run of pieces);
    a run's text followed by what it decodes to in turn, up to ``encodings`` deep."""
    data = text.encode("ascii", "replace")  # one byte a character
    found = _ANY_FORM.Match(data) or ()
    runs = sorted(run for form in found for run in _READERS[form](data))
    return _with_inner(runs, encodings - 1) if encodings > 1 and runs else runs


def _with_inner(runs: list[Decoded], encodings: int) -> list[Decoded]:
    """The runs, each followed by what its text decodes to in turn: the whole run is what
    hides that text too. Their texts are read as one (a scan of each would cost more than
    the reading); runs that one inner run lies across become one."""
    joined = Joined([run.text for run in runs])
    groups: list[tuple[int, int, list[str]]] = []  # first and last run, the inner texts
    for inner in decoded_runs(joined.text, encodings):
        first, last = joined.index_at(inner.start), joined.index_at(inner.end - 1)
        if groups and first <= groups[-1][1]:
            first, last = groups[-1][0], max(last, groups[-1][1])
            groups[-1] = (first, last, [*groups[-1][2], inner.text])
        else:
            groups.append((first, last, [inner.text]))
    read, at = [], 0
    for first, last, texts in groups:
        read += runs[at:first]
        outer = runs[first : last + 1]
        start, end = min(r.start for r in outer), max(r.end for r in outer)
        read.append(Decoded(start, end, SEPARATOR.join([*(r.text for r in outer), *texts])))
        at = last + 1
    return read + runs[at:]


def _whole_runs(data: bytes) -> Iterator[Decoded]:
    """Each run read as base64 and as hexadecimal (both readings, when both read:
    hexadecimal digits are base64 characters too, and one of the two is gibberish)."""
    for start, end in [match.span() for match in _RUN.finditer(data)]:
        run = data[start:end]
        if _UPPER_OR_DIGIT.search(run) is None:
            continue
        readings = [_base64(run), *map(_hex, _HEX_RUN.findall(run))]
        decoded = SEPARATOR.join(r for r in readings if r is not None)
        if decoded:
            yield Decoded(start, end, decoded)


def _hex_pieces(data: bytes) -> Iterator[Decoded]:
    """Hexadecimal digits written apart, read as one run (a piece of an odd number of
    digits shifts the bytes after it, which the reading follows)."""
    for match in _HEX_PIECES.finditer(data):
        digits = b"".join(_HEX_PIECE.findall(data, *match.span()))
        decoded = _hex(digits) if len(digits) >= _MIN_HEX_DIGITS else None
        if decoded is not None:
            yield Decoded(match.start(), match.end(), decoded)


def _base64_pieces(data: bytes) -> Iterator[Decoded]:
    """Base64 written apart, each stretch of pieces of one length read as one."""
    for match in _BASE64_PIECES.finditer(data):
        pieces = [piece.span() for piece in _BASE64_PIECE.finditer(data, *match.span())]
        for first, last in _one_length(pieces):
            decoded = _read_pieces(data, pieces[first : last + 1])
            if decoded is not None:
                yield decoded


def _read_pieces(data: bytes, pieces: list[Span]) -> Decoded | None:
    """What the pieces read as, without the piece at either end if all it adds to that is
    a stretch of its own (a word of the pieces' length before them, a shorter one after
    them), so that a redaction leaves those words be. (One at each end: each costs a
    reading.)"""
    decoded = _pieces_base64(data, pieces)
    if decoded is None:
        return None
    if len(pieces) > 2:
        rest = _pieces_base64(data, pieces[1:])
        if rest is not None and (rest == decoded or decoded.endswith(SEPARATOR + rest)):
            pieces, decoded = pieces[1:], rest
    if len(pieces) > 2 and data[slice(*pieces[-1])].strip(b"="):  # (padding is the run's)
        rest = _pieces_base64(data, pieces[:-1])
        if rest is not None and (rest == decoded or decoded.startswith(rest + SEPARATOR)):
            pieces, decoded = pieces[:-1], rest
    return Decoded(pieces[0][0], pieces[-1][1], decoded)


def _pieces_base64(data: bytes, pieces: list[Span]) -> str | None:
    body = b"".join(data[start:end] for start, end in pieces)
    if len(body) < _MIN_RUN or _UPPER_OR_DIGIT.search(body) is None:
        return None
    return _base64(body)


_READERS: tuple[Callable[[bytes], Iterator[Decoded]], ...] = (
    _whole_runs,
    _hex_pieces,
    _base64_pieces,
)
# One scan says which of the forms a text holds (most hold none), each then looked for.
_ANY_FORM = re2.Set.SearchSet()
for _form in (_RUN, _HEX_PIECES, _BASE64_PIECES):
    _ANY_FORM.Add(_form.pattern)
_ANY_FORM.Compile()


def _one_length(pieces: list[Span]) -> Iterator[Span]:
    """The first and last index of each stretch of two pieces or more that are all of one
    length but the last, which may be shorter: how an encoder breaks a string into lines
    or groups. (A piece longer than those before it begins the next stretch: a character
    put in front of the first piece is one.)"""
    first = 0
    while first < len(pieces) - 1:
        length = _width(pieces[first])
        after = first + 1
        while after < len(pieces) and _width(pieces[after]) == length:
            after += 1
        last = after if after < len(pieces) and _width(pieces[after]) < length else after - 1
        if last > first:
            yield first, last
        first = after


def _width(span: Span) -> int:
    return span[1] - span[0]


def _hex(digits: bytes) -> str | None:
    """What hexadecimal digits read as, from either place a byte may begin."""
    return read_text(
        Decoding(skip, 2, binascii.unhexlify(digits[skip : skip + (len(digits) - skip) // 2 * 2]))
        for skip in (0, 1)
    )


def _base64(run: bytes) -> str | None:
    """What a run of base64 reads as, from each of the four places a group of four may
    begin (a character put in front of the text, or among it, shifts every group after
    it)."""
    body = run.rstrip(b"=").translate(_URL_SAFE)
    if body.isdigit():
        return None  # a number, or a row of them: hexadecimal or nothing (_DIGITS_ONLY)
    whole = _groups(body)
    if len(whole) >= MIN_TEXT and whole.isascii() and _CONTROL.search(whole) is None:
        return whole.decode("ascii")  # all of it text: no other reading says more
    return read_text(Decoding(skip, 4 / 3, _groups(body[skip:])) for skip in range(4))


def _groups(body: bytes) -> bytes:
    """What base64 characters (standard alphabet, no padding) decode to, an unfinished
    last group as far as it goes."""
    body = body[: len(body) // 4 * 4 + _LAST_GROUP[len(body) % 4]]
    return binascii.a2b_base64(body + b"=" * (-len(body) % 4))


class DecodedText:
    """The decoded runs of a text, joined into one text for the rules to read once (as a
    prompt's parts are: a phrase split across two runs is found)."""

    __slots__ = ("_joined", "runs")

    def __init__(self, runs: tuple[Decoded, ...]) -> None:
        self.runs = runs
        self._joined = Joined([run.text for run in runs])

    @classmethod
    def of(cls, text: str) -> DecodedText:
        return cls(tuple(decoded_runs(text)))

    @property
    def text(self) -> str:
        return self._joined.text

    def span(self, start: int, end: int) -> tuple[int, int]:
        """The original span of the runs that a match of ``text[start:end]`` lies in."""
        first = self._joined.index_at(start)
        last = self._joined.index_at(max(end - 1, start))
        return self.runs[first].start, self.runs[last].end


def encoded_hits(matcher: Matcher, views: Views) -> list[Hit]:
    """The matcher's matches in what the encoded runs of a text decode to, each the hit of
    the whole runs it lies in. The runs are looked for in the text's pattern view, where
    escapes are read, invisible characters dropped and fullwidth ones made ASCII (a model
    reads encoded text through those as through any other)."""
    view = views.get("pattern")
    decoded = DecodedText.of(view.text)
    if not decoded.runs:
        return []
    found = []
    for hit in matcher.hits(decoded.text):
        if hit.valid:
            start, end = decoded.span(hit.start, hit.end)
            found.append(replace(hit, start=view.start(start), end=view.end(end)))
    return found

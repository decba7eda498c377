"""Text a model reads through an encoding of a whole string: base64 (standard or URL-safe)
and hexadecimal. Unlike an escape (llmmesh/policy/escapes.py), such a string has no
character that stands for one character of what it says, so a match in what it decodes to
is a match of the whole string: a deny rule denies, a redaction replaces all of it.

A run is read as far as it decodes to UTF-8 text without control characters, and only if
that is 8 bytes or more: a hash, a key or a word that happens to be valid base64 mostly
decodes to bytes that are not text (and the rare one that reads as text is gibberish that
no rule matches). Characters put before the encoded text, or after it, do not hide it: each
place its groups may begin is tried, and the longest reading kept. Only in what a model
will read (the input check): the streamed output is checked as written.
"""

from __future__ import annotations

import binascii
import re
from collections.abc import Iterable, Iterator
from dataclasses import replace
from typing import NamedTuple

import re2

from llmmesh.policy.joined import Joined
from llmmesh.policy.matching import Hit, Matcher

# A run long enough to hide a phrase (9 bytes of base64, "bioweapon"; 6 of hexadecimal,
# below _MIN_TEXT). One scan for both alphabets: hexadecimal digits are base64 characters
# too, and a run of them is read both ways.
_MIN_RUN = 12
_RUN_TEXT = f"[A-Za-z0-9+/_-]{{{_MIN_RUN},}}={{0,2}}"
# RE2 finds runs in a few microseconds a kilobyte where Python's engine tries each place
# one may start, but costs microseconds a match to hand back a str's, and less a bytes'.
# ASCII text is scanned as bytes, whose positions are its characters'; other text is
# asked first whether it holds a run at all, and then scanned by Python's engine.
_ASCII_RUN = re2.compile(_RUN_TEXT.encode("ascii"))
_ANY_RUN = re2.compile(_RUN_TEXT)
_RUN = re.compile(_RUN_TEXT)
_HEX_RUN = re.compile(f"[0-9A-Fa-f]{{{_MIN_RUN},}}")
_URL_SAFE = bytes.maketrans(b"-_", b"+/")
# A run without an upper-case letter or a digit (a snake_case name, a path) is left alone:
# the base64 of text always has one, save a text made for it (every third of its
# characters one of "jknorsvwz{~"), and the hexadecimal of text always has digits.
_UPPER_OR_DIGIT = re.compile("[A-Z0-9]")
_MIN_TEXT = 8  # bytes of text, at least
# How many characters of an unfinished last group of four are read: 2 or 3 are a byte or
# two; a lone one is none.
_LAST_GROUP = (0, 0, 2, 3)
# Where text read from bytes ends: a control character (but the line breaks and the tab),
# which text does not hold and bytes that are no text do, or U+FFFD, where the bytes stop
# being UTF-8. (Format characters stay: text hidden with zero-width ones is text.)
_UNREADABLE = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\ufffd]")


class Decoded(NamedTuple):
    """A run of ``text[start:end]`` and the text it decodes to."""

    start: int
    end: int
    text: str


def decoded_runs(text: str) -> Iterator[Decoded]:
    """The runs of ``text`` that decode, as base64 or hexadecimal, to readable text (the
    longer reading when both do: hexadecimal digits are base64 characters too)."""
    for start, end in _run_spans(text):
        run = text[start:end]
        if _UPPER_OR_DIGIT.search(run) is None:
            continue
        decoded = _base64(run)
        hexadecimal = _HEX_RUN.findall(run)
        if hexadecimal:
            decoded = _longest([decoded, *map(_hex, hexadecimal)])
        if decoded is not None:
            yield Decoded(start, end, decoded)


def _run_spans(text: str) -> list[tuple[int, int]]:
    if text.isascii():
        return [match.span() for match in _ASCII_RUN.finditer(text.encode("ascii"))]
    if _ANY_RUN.search(text) is None:
        return []
    return [match.span() for match in _RUN.finditer(text)]


def _longest(readings: Iterable[str | None]) -> str | None:
    return max((r for r in readings if r is not None), key=len, default=None)


def _hex(run: str) -> str | None:
    """What a run of hexadecimal digits decodes to, as far as it reads as text, from
    whichever of the two places a byte may begin reads longer."""
    return _longest(
        _readable(bytes.fromhex(run[skip : skip + (len(run) - skip) // 2 * 2])) for skip in (0, 1)
    )


def _base64(run: str) -> str | None:
    """What the run decodes to as base64, as far as it reads as text (a character put after
    the text ends it there), from whichever of the four places a group of four may begin
    reads longest (a character put in front of the text shifts every group after it)."""
    body = run.rstrip("=").encode("ascii").translate(_URL_SAFE)
    best = None
    for skip in range(4):
        data = _groups(body[skip:])
        decoded = _readable(data)
        if decoded is None:
            continue
        if len(decoded) == len(data):  # all of it read, as ASCII: no reading is longer
            return decoded
        if best is None or len(decoded) > len(best):
            best = decoded
    return best


def _groups(body: bytes) -> bytes:
    """What base64 characters (standard alphabet, no padding) decode to, an unfinished
    last group as far as it goes."""
    body = body[: len(body) // 4 * 4 + _LAST_GROUP[len(body) % 4]]
    return binascii.a2b_base64(body + b"=" * (-len(body) % 4))


def _readable(data: bytes) -> str | None:
    """The text ``data`` begins with, as far as it is UTF-8 without control characters
    (but line breaks and tabs), if that is long enough to say something."""
    text = data.decode("utf-8", "replace")  # U+FFFD where it stops being UTF-8
    end = _UNREADABLE.search(text)
    text = text if end is None else text[: end.start()]
    return text if len(text) >= _MIN_TEXT or len(text.encode("utf-8")) >= _MIN_TEXT else None


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


def encoded_hits(matcher: Matcher, text: str) -> list[Hit]:
    """The matcher's matches in what the encoded runs of ``text`` decode to, each the hit
    of the whole runs it lies in."""
    decoded = DecodedText.of(text)
    if not decoded.runs:
        return []
    found = []
    for hit in matcher.hits(decoded.text):
        if hit.valid:
            start, end = decoded.span(hit.start, hit.end)
            found.append(replace(hit, start=start, end=end))
    return found

"""Text a model reads through an encoding of a whole string: base64 (standard or URL-safe)
and hexadecimal. Unlike an escape (llmmesh/policy/escapes.py), such a string has no
character that stands for one character of what it says, so a match in what it decodes to
is a match of the whole string: a deny rule denies, a redaction replaces all of it.

Only a run that decodes to readable UTF-8 text counts (a hash, a key or a word that happens
to be valid base64 decodes to bytes that are not), and only in what a model will read (the
input check).
"""

from __future__ import annotations

import base64
import binascii
import bisect
import re
from collections.abc import Iterator
from dataclasses import dataclass, replace

import re2

from llmmesh.policy.matching import Hit, Matcher

# A run long enough to hide a phrase (12 bytes of base64, 8 of hexadecimal). One scan for
# both alphabets: hexadecimal digits are base64 characters too.
_MIN_RUN = 16
_RUN = re2.compile(f"[A-Za-z0-9+/_-]{{{_MIN_RUN},}}={{0,2}}")
_HEX_DIGITS = frozenset("0123456789abcdefABCDEF")
_URL_SAFE = bytes.maketrans(b"-_", b"+/")
# What text does not hold and bytes that are no text do: control characters but the line
# breaks and the tab. (Format characters stay: text hidden with zero-width ones is text.)
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")
# Between decoded runs in the text the rules read: as between a prompt's parts.
_SEPARATOR = "\n"


@dataclass(frozen=True)
class Decoded:
    """A run of ``text[start:end]`` and the text it decodes to."""

    start: int
    end: int
    text: str


def decoded_runs(text: str) -> Iterator[Decoded]:
    """The runs of ``text`` that decode, as hexadecimal or base64, to readable text."""
    for match in _RUN.finditer(text):
        run = match.group()
        decoded = _hex(run) if set(run) <= _HEX_DIGITS else None
        decoded = decoded if decoded is not None else _base64(run)
        if decoded is not None:
            yield Decoded(match.start(), match.end(), decoded)


def _hex(run: str) -> str | None:
    if len(run) % 2:
        return None
    return _readable(bytes.fromhex(run))


def _base64(run: str) -> str | None:
    body = run.rstrip("=")
    if len(body) % 4 == 1:  # no base64 text ends so
        return None
    # The URL-safe alphabet mapped onto the standard one, the padding made whole.
    padded = body.encode("ascii").translate(_URL_SAFE) + b"=" * (-len(body) % 4)
    try:
        return _readable(base64.b64decode(padded, validate=True))
    except binascii.Error:
        return None


def _readable(data: bytes) -> str | None:
    """``data`` as text, if it is UTF-8 without control characters (but line breaks, tabs)."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return None
    return None if _CONTROL.search(text) else text


@dataclass(frozen=True)
class DecodedText:
    """The decoded runs of a text, joined into one text for the rules to read once."""

    runs: tuple[Decoded, ...]
    text: str
    starts: tuple[int, ...]  # where each run's decoded text starts in ``text``

    @classmethod
    def of(cls, text: str) -> DecodedText:
        runs = tuple(decoded_runs(text))
        starts, offset = [], 0
        for run in runs:
            starts.append(offset)
            offset += len(run.text) + len(_SEPARATOR)
        return cls(runs, _SEPARATOR.join(r.text for r in runs), tuple(starts))

    def span(self, start: int, end: int) -> tuple[int, int]:
        """The original span of the runs that a match of ``text[start:end]`` lies in."""
        first = bisect.bisect_right(self.starts, start) - 1
        last = bisect.bisect_right(self.starts, max(end - 1, start)) - 1
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

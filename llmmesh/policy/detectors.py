"""Built-in PII and secret detectors, compiled with RE2 (linear time whatever the input),
each with a validator where a pattern alone over-matches (Luhn and issuers' prefixes for
cards, mod 97 for IBANs, octet ranges for IPv4)."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import re2

from llmmesh.policy.partial import prefix_pattern

# Luhn's check on the digits as characters (a long run of digits and spaces makes a match
# at every group, and checks several prefixes of each: each check is a few string calls).
_CARD_SEPARATORS = str.maketrans("", "", " -./_")
_DOUBLED = str.maketrans("0123456789", "0246813579")  # a digit doubled, its digits summed


def _card(text: str) -> bool:
    digits = text.translate(_CARD_SEPARATORS)
    if not 13 <= len(digits) <= 19 or not digits.isascii() or not digits.isdigit():
        return False
    return _issued(digits) and _luhn(digits)


def _luhn(digits: str) -> bool:
    plain, doubled = digits[-1::-2], digits[-2::-2].translate(_DOUBLED)
    return (sum(plain.encode()) + sum(doubled.encode()) - ord("0") * len(digits)) % 10 == 0


def _issued(digits: str) -> bool:
    """Whether a card network issues numbers that begin so (ISO/IEC 7812): none begins
    with 0; of those with 1, only UATP's, of 15 digits; of those with 2, only Mir's
    (2200-2204) and Mastercard's (2221-2720). A row of years (19xx, 20xx) passes Luhn one
    time in ten, and is no card."""
    if digits[0] == "0":
        return False
    if digits[0] == "1":
        return len(digits) == 15
    if digits[0] == "2":
        prefix = int(digits[:4])
        return 2200 <= prefix <= 2204 or 2221 <= prefix <= 2720
    return True


def _iban(text: str) -> bool:
    compact = text.replace(" ", "").upper()
    rearranged = compact[4:] + compact[:4]
    number = "".join(str(int(c, 36)) for c in rearranged)
    return int(number) % 97 == 1


def _ipv4(text: str) -> bool:
    return all(int(part) <= 255 for part in text.split("."))


def _phone(text: str) -> bool:
    return 9 <= sum(c.isdigit() for c in text) <= 15


_WORD_END = re.compile(r"(?<=[^\W_])(?=[\W_])")  # after a letter or digit, before neither


@dataclass(frozen=True)
class Detector:
    """A named pattern with a typed placeholder. ``partial`` (RE2 syntax) matches every
    text that may still grow into a match, and possibly more: the streamed output check
    holds back a tail it matches. ``valid`` refuses pattern matches that are not the
    thing (a card number that fails Luhn)."""

    name: str
    placeholder: str
    pattern: Any  # re2 pattern
    partial: str | None
    valid: Callable[[str], bool]

    def accepts(self, match: str) -> bool:
        """Whether a match of the pattern is the thing, or begins with it: the pattern is
        greedy, so a card number with its security code after it is matched as one
        number that fails Luhn (the whole match is then taken for the thing)."""
        if self.valid(match):
            return True
        ends = [word_end.start() for word_end in _WORD_END.finditer(match)]
        return any(
            self.valid(match[:end]) and self.pattern.fullmatch(match[:end]) is not None
            for end in reversed(ends)
        )


def matches(detector: Detector, text: str, pos: int = 0) -> Iterator[tuple[int, int, bool]]:
    """Where each match of the detector's pattern in ``text`` from ``pos`` starts and ends,
    and whether it is the thing (``Detector.accepts``). One that is not hides nothing: the
    search goes on from inside it (a card number after other digits, an address after an
    octet out of range)."""
    # The text goes to RE2 as UTF-8 bytes, encoded once: given a str, the wrapper encodes
    # it and walks it to map positions on every search, which made a 60 KB table of
    # numbers with one character that is not ASCII take seconds, not a tenth of one.
    data = text.encode()
    chars = _Utf8Positions(data) if len(data) != len(text) else None
    at = pos if chars is None else len(text[:pos].encode())
    while (match := detector.pattern.search(data, at)) is not None:
        start, end = match.span()
        if chars is not None:
            start, end = chars.forward_to(start), chars.ahead(end)
        accepted = detector.accepts(text[start:end])
        yield start, end, accepted
        at = match.end() if accepted else match.start() + len(text[start].encode())


_CONTINUATION = bytes(range(0x80, 0xC0))  # the bytes of UTF-8 that go on a character


class _Utf8Positions:
    """Positions in a text of positions in its UTF-8 ``data``, asked for going forwards
    (each byte is counted once, however many matches there are)."""

    def __init__(self, data: bytes) -> None:
        self._data = data
        self._byte = self._char = 0

    def forward_to(self, byte: int) -> int:
        self._char = self.ahead(byte)
        self._byte = byte
        return self._char

    def ahead(self, byte: int) -> int:
        """At or after the last ``forward_to``, without moving there."""
        return self._char + len(self._data[self._byte : byte].translate(None, _CONTINUATION))


DETECTORS: dict[str, Detector] = {}


def register_detector(
    name: str,
    placeholder: str,
    pattern: str,
    valid: Callable[[str], bool] | None = None,
    partial: str | None = None,
) -> Detector:
    """Makes a detector usable in rule sets as ``detectors: [name]``. Its partial form is
    derived from the pattern (as a regex rule's is) unless given."""
    derived = partial if partial is not None else prefix_pattern(pattern)
    if derived is not None:
        try:
            re2.compile(derived)
        except re2.error:
            derived = None  # held back by the pattern's longest width instead
    detector = Detector(name, placeholder, re2.compile(pattern), derived, valid or _any)
    DETECTORS[name] = detector
    return detector


def _any(_: str) -> bool:
    return True


register_detector(
    "email",
    "[EMAIL]",
    r"\b[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}\b",
)
# An address spelled out against harvesters (ada [at] example [dot] com), as pages copied
# into prompts have them. Its own detector: any word and a space may begin one, so in a
# streamed output it would hold back every word's trailing space.
_AT = r" ?[\[({] ?(?i:at) ?[\])}] ?"
_DOT = r"(?:\.| ?[\[({] ?(?i:dot) ?[\])}] ?)"
register_detector(
    "email_spelled_out",
    "[EMAIL]",
    rf"\b[A-Za-z0-9._%+-]+{_AT}[A-Za-z0-9-]+(?:{_DOT}[A-Za-z0-9-]+)*{_DOT}[A-Za-z]{{2,}}\b",
)
register_detector(
    "credit_card",
    "[CREDIT_CARD]",
    # In the groups cards are printed in (4-4-4-4, with a code or more digits after them
    # or not, 4-6-5 and 4-6-4) between spaces, dashes, dots, slashes or underscores, mixed
    # or not (dots, slashes and underscores taken anywhere would read decimals and dates as
    # cards); in other groups of three digits or more between single spaces or dashes;
    # 13-19 digits in a row; or each digit apart. Not in groups of two: a hexadecimal
    # dump, a row of numbers (every tenth passing Luhn), and no card.
    r"\b(?:\d{4}(?:[ ./_-]\d{4}){3}(?:[ ./_-]\d{1,3})?|\d{4}[ ./_-]\d{6}[ ./_-]\d{4,5}"
    r"|\d{3,19}(?:[ -]\d{3,19}){1,5}|\d{13,19}|\d(?:[ -]\d){12,18})\b",
    _card,
)
register_detector("iban", "[IBAN]", r"\b[A-Z]{2}\d{2}(?: ?[A-Z0-9]){11,30}\b", _iban)
register_detector("ip_address", "[IP_ADDRESS]", r"\b(?:\d{1,3}\.){3}\d{1,3}\b", _ipv4)
register_detector("ip_address_v6", "[IP_ADDRESS]", r"\b(?:[0-9A-Fa-f]{1,4}:){7}[0-9A-Fa-f]{1,4}\b")
register_detector(
    "api_key",
    "[SECRET]",
    r"\b(?:sk|pk|rk|ghp|gho|ghs|xox[abp]|AKIA|llmm)[-_]?[A-Za-z0-9_-]{16,}\b",
)
register_detector(
    "phone",
    "[PHONE]",
    # International (+CC ...), (area) local, or NNN-NNN-NNNN: bare digit runs are left
    # alone (they are as often order numbers as phones).
    r"(?:\+\d{1,3}[ .-]?(?:\(\d{1,4}\)[ .-]?)?\d(?:[ .-]?\d){6,12}"
    r"|\(\d{2,4}\)[ .-]?\d{3,4}[ .-]?\d{3,4}|\b\d{3}[.-]\d{3}[.-]\d{4})\b",
    _phone,
)


def find(text: str, names: list[str]) -> list[tuple[int, int, str]]:
    """(start, end, placeholder) of every valid match, earliest and longest first, none
    overlapping."""
    spans: list[tuple[int, int, str]] = []
    for name in names:
        detector = DETECTORS[name]
        for start, end, accepted in matches(detector, text):
            if accepted:
                spans.append((start, end, detector.placeholder))
    return disjoint(spans)


def disjoint(spans: list[tuple[int, int, str]]) -> list[tuple[int, int, str]]:
    """Earliest first, the longest at a position; a later span that overlaps one kept
    extends it (under the kept one's placeholder): no part of any match is let out."""
    ordered = sorted(spans, key=lambda s: (s[0], -(s[1] - s[0])))
    kept: list[tuple[int, int, str]] = []
    for start, end, placeholder in ordered:
        if kept and start < kept[-1][1]:
            first, last, shown = kept[-1]
            kept[-1] = (first, max(last, end), shown)
        else:
            kept.append((start, end, placeholder))
    return kept


def redact(text: str, spans: list[tuple[int, int, str]]) -> str:
    out, last = [], 0
    for start, end, placeholder in spans:
        out += [text[last:start], placeholder]
        last = end
    out.append(text[last:])
    return "".join(out)

r"""Escapes that stand for characters, as a model or a client's page reads them: HTML
character references (``&#98;``, ``&#x62;``, ``&commat;``, and the legacy names without a
semicolon, as browsers read them), URL percent-escapes (``%62``; a run of them is UTF-8,
``%C3%A9`` one character) and the backslash escapes of JSON, Python, JavaScript and C
(``\x62``, a run of them UTF-8 as well; ``\u0062``, a run of them UTF-16, so
``\ud83d\udca3`` is one character; ``\U0001F4A3``, ``\u{1F4A3}``). The normalized views
read each as the character it stands for (llmmesh/policy/normalize.py).

An escape is read whole, on its own: a character of an escaped UTF-8 or UTF-16 run is
the escapes of its bytes or code units, so text after a complete one cannot change how it
reads. Text that more text could still make into an escape, or into a longer one (``&``,
``&#9``, ``&amp``, ``%``, ``%6``, ``%C3``, ``\``, ``\u00``, ``\ud83d``), is its tail
(``escape_start``): a stream holds it.
"""

from __future__ import annotations

import functools
import html
import re
from collections.abc import Iterator
from dataclasses import dataclass

# A run that may be a character reference: a number (at most what Unicode needs, and then
# some: a longer one reads as U+FFFD, as html.unescape reads it) or a name (the longest of
# HTML's is 31 characters), with its semicolon if any. html.unescape says what it is.
_REFERENCE = re.compile(r"&(?:#[xX][0-9a-fA-F]{1,8}|#[0-9]{1,10}|[A-Za-z][A-Za-z0-9]{0,31});?")
_REFERENCE_TAIL = re.compile(r"&(?:#[xX]?[0-9a-fA-F]{0,10}|[A-Za-z][A-Za-z0-9]{0,31})?\Z")
# The longest tail: a reference's; a backslash escape's with an unpaired surrogate before
# it, or an escaped UTF-8 sequence's, is shorter.
_LONGEST_TAIL = 34
# An escape begun: a percent-escape (``%``, ``%C``) or a backslash one (``\``, ``\u00``,
# ``\u{1F4``). At most one of the two ends a text.
_BEGUN = re.compile(
    r"%[0-9A-Fa-f]?\Z"
    r"|\\(?:x[0-9A-Fa-f]?|u[0-9A-Fa-f]{0,3}|u\{[0-9A-Fa-f]{0,6}|U[0-9A-Fa-f]{0,7})?\Z"
)
_HIGH_SURROGATE_END = re.compile(r"\\u[dD][89abAB][0-9A-Fa-f]{2}\Z")
# Every backslash escape, in one scan: a run of ``\x`` escapes, a run of ``\u`` escapes,
# or one ``\U`` or ``\u{}`` escape. (Each pattern here begins with its literal, which
# the regex engine looks for first: several times faster than a group that repeats.)
_BACKSLASHED = re.compile(
    r"\\(?:(?P<hex>x[0-9A-Fa-f]{2}(?:\\x[0-9A-Fa-f]{2})*)"
    r"|(?P<utf16>u[0-9A-Fa-f]{4}(?:\\u[0-9A-Fa-f]{4})*)"
    r"|U(?P<code>[0-9A-Fa-f]{8})|u\{(?P<braced>[0-9A-Fa-f]{1,6})\})"
)
_LONGEST_CHARACTER = 4  # UTF-8 bytes
_REPLACEMENT = "\ufffd"

# start -> (end, what the escape at ``start`` stands for)
Escapes = dict[int, tuple[int, str]]

# A text's references repeat (``&amp;``, an escaped letter): each read once.
_unescape = functools.lru_cache(maxsize=4096)(html.unescape)


@dataclass(frozen=True)
class _Units:
    """Escapes of fixed width, each of one code unit, a run of them read in an encoding:
    ``%XX`` and ``\\xXX`` bytes of UTF-8, ``\\uXXXX`` code units of UTF-16."""

    prefix: str
    digits: int  # hexadecimal digits after the prefix

    @functools.cached_property
    def run(self) -> re.Pattern[str]:
        one = f"{re.escape(self.prefix)}[0-9A-Fa-f]{{{self.digits}}}"
        return re.compile(f"{one}(?:{one})*")

    @property
    def width(self) -> int:
        return len(self.prefix) + self.digits

    def data(self, run: str) -> bytes:
        """The bytes a run of these escapes writes (a code unit's, most significant
        first)."""
        return bytes.fromhex(run.replace(self.prefix, ""))


_PERCENT = _Units("%", 2)
_HEX = _Units("\\x", 2)
_UTF16 = _Units("\\u", 4)


def escapes(text: str) -> Escapes:
    """The escapes in ``text`` that stand for something other than themselves."""
    found: Escapes = {}
    if "&" in text:
        for match in _REFERENCE.finditer(text):
            reference = match.group()
            decoded = _unescape(reference)
            if decoded != reference:
                found[match.start()] = (match.end(), decoded)
    if "%" in text:
        for match in _PERCENT.run.finditer(text):
            _utf8_run(found, match.group(), match.start(), _PERCENT)
    if "\\" in text:
        for match in _BACKSLASHED.finditer(text):
            _backslashed(found, match)
    return found


def _backslashed(found: Escapes, match: re.Match[str]) -> None:
    """The characters of a backslash escape, or of a run of them, into ``found``."""
    run, at = match.group(), match.start()
    if match.lastgroup == "hex":
        _utf8_run(found, run, at, _HEX)
    elif match.lastgroup == "utf16":
        _utf16_run(found, run, at)
    else:
        found[at] = (match.end(), _character(int(match[match.lastgroup or "code"], 16)))


def _character(code: int) -> str:
    """The character of a code point; U+FFFD for a surrogate or past Unicode's end."""
    return _REPLACEMENT if 0xD800 <= code < 0xE000 or code > 0x10FFFF else chr(code)


def _utf8_run(found: Escapes, run: str, at: int, units: _Units) -> None:
    """The characters of a run at ``at`` of escaped bytes, into ``found``: each complete
    UTF-8 sequence one character; a byte that begins none (or an unfinished one) reads as
    U+FFFD."""
    data, width = units.data(run), units.width
    if data.isascii():  # the common case: a character per escape
        for i, byte in enumerate(data):
            found[at + width * i] = (at + width * (i + 1), chr(byte))
        return
    i = 0
    while i < len(data):
        size = _sequence_size(data, i)
        try:
            character = data[i : i + size].decode("utf-8")
        except UnicodeDecodeError:
            character, size = _REPLACEMENT, 1
        found[at + width * i] = (at + width * (i + size), character)
        i += size


def _utf16_run(found: Escapes, run: str, at: int) -> None:
    """The characters of a run at ``at`` of ``\\uXXXX`` escapes, into ``found``: a
    surrogate pair one character, a surrogate without its pair U+FFFD."""
    data, width = _UTF16.data(run), _UTF16.width
    values = [data[i] << 8 | data[i + 1] for i in range(0, len(data), 2)]
    if not any(0xD800 <= value < 0xE000 for value in values):  # a character per escape
        for i, value in enumerate(values):
            found[at + width * i] = (at + width * (i + 1), chr(value))
        return
    for i, size, character in _utf16_pieces(values):
        found[at + width * i] = (at + width * (i + size), character)


def _utf16_pieces(values: list[int]) -> Iterator[tuple[int, int, str]]:
    """(first unit, units, character) of each character of UTF-16 code units."""
    i = 0
    while i < len(values):
        unit = values[i]
        following = values[i + 1] if i + 1 < len(values) else None
        if _high_surrogate(unit) and following is not None and 0xDC00 <= following < 0xE000:
            code = 0x10000 + ((unit - 0xD800) << 10) + (following - 0xDC00)
            yield i, 2, chr(code)
            i += 2
        else:
            yield i, 1, _character(unit)
            i += 1


def _high_surrogate(unit: int) -> bool:
    return 0xD800 <= unit < 0xDC00


def _sequence_size(data: bytes, i: int) -> int:
    """How many bytes the UTF-8 sequence its lead byte ``data[i]`` begins has (1 for a
    byte that begins none)."""
    lead = data[i]
    if lead < 0xC2 or lead > 0xF4:
        return 1
    return 2 if lead < 0xE0 else 3 if lead < 0xF0 else 4


def escape_start(text: str) -> int | None:
    """Where the tail of ``text`` that more text could make into an escape (or change the
    reading of) starts, if it ends in one."""
    end = text[-_LONGEST_TAIL:]
    if "&" not in end and "%" not in end and "\\" not in end:  # most texts: no need to look
        return None
    amp = text.rfind("&", max(len(text) - _LONGEST_TAIL, 0))
    if amp >= 0 and _REFERENCE_TAIL.match(text, amp) is not None:
        return amp
    # An escape begun, and before it a character not yet finished (``%C3`` of
    # ``%C3%A9``, ``\ud83d`` of ``\ud83d\udca3``): the earlier of the two.
    begun = _BEGUN.search(text, max(len(text) - _LONGEST_TAIL, 0))
    head = text if begun is None else text[: begun.start()]
    unfinished = [
        start
        for start in (
            _unfinished_utf8(head, _PERCENT),
            _unfinished_utf8(head, _HEX),
            _unpaired_surrogate(head),
        )
        if start is not None
    ]
    if unfinished:
        return min(unfinished)
    return None if begun is None else begun.start()


def _unfinished_utf8(text: str, units: _Units) -> int | None:
    """The start of an escaped UTF-8 sequence the text ends before its end."""
    window = units.width * (_LONGEST_CHARACTER - 1)
    run = units.run.search(text, max(len(text) - window, 0))
    while run is not None and run.end() != len(text):
        run = units.run.search(text, run.end())
    if run is None:
        return None
    data = units.data(run.group())
    for back in range(1, min(len(data), _LONGEST_CHARACTER - 1) + 1):
        i = len(data) - back
        if data[i] & 0xC0 != 0x80:  # a lead byte (or a byte of its own)
            size = _sequence_size(data, i)
            return run.start() + units.width * i if size > back else None
    return None


def _unpaired_surrogate(text: str) -> int | None:
    """The start of a ``\\uXXXX`` high surrogate that ends the text, its pair to come
    (whatever precedes it: a low surrogate begins no pair)."""
    last = _HIGH_SURROGATE_END.search(text, max(len(text) - _UTF16.width, 0))
    return None if last is None else last.start()

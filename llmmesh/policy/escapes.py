"""Escapes that stand for characters, as a model or a client's page reads them: HTML
character references (``&#98;``, ``&#x62;``, ``&commat;``, and the legacy names without a
semicolon, as browsers read them) and URL percent-escapes (``%62``; a run of them is UTF-8,
``%C3%A9`` one character). The normalized views read each as the character it stands
for (llmmesh/policy/normalize.py).

An escape is read whole, on its own: a character of a percent-escaped run is the escapes
of its UTF-8 bytes, so text after a complete one cannot change how it reads. Text that
more text could still make into an escape, or into a longer one (``&``, ``&#9``, ``&amp``,
``%``, ``%6``, ``%C3``), is its tail (``escape_start``): a stream holds it.
"""

from __future__ import annotations

import functools
import html
import re

# A run that may be a character reference: a number (at most what Unicode needs, and then
# some: a longer one reads as U+FFFD, as html.unescape reads it) or a name (the longest of
# HTML's is 31 characters), with its semicolon if any. html.unescape says what it is.
_REFERENCE = re.compile(r"&(?:#[xX][0-9a-fA-F]{1,8}|#[0-9]{1,10}|[A-Za-z][A-Za-z0-9]{0,31});?")
_REFERENCE_TAIL = re.compile(r"&(?:#[xX]?[0-9a-fA-F]{0,10}|[A-Za-z][A-Za-z0-9]{0,31})?\Z")
_LONGEST_REFERENCE_TAIL = 34
_PERCENT_RUN = re.compile(r"(?:%[0-9A-Fa-f]{2})+")
_PERCENT_TAIL = re.compile(r"%[0-9A-Fa-f]?\Z")
_ESCAPE = len("%XX")
_LONGEST_CHARACTER = 4  # UTF-8 bytes

# start -> (end, what the escape at ``start`` stands for)
Escapes = dict[int, tuple[int, str]]

# A text's references repeat (``&amp;``, an escaped letter): each read once.
_unescape = functools.lru_cache(maxsize=4096)(html.unescape)


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
        for run in _PERCENT_RUN.finditer(text):
            found.update(_percent_characters(run.group(), run.start()))
    return found


def _percent_characters(run: str, at: int) -> Escapes:
    """The characters of a run of percent-escapes at ``at``: each complete UTF-8 sequence
    one character; a byte that begins none (or an unfinished one) reads as U+FFFD."""
    data = bytes.fromhex(run.replace("%", ""))
    if data.isascii():  # the common case: a character per escape
        return {at + _ESCAPE * i: (at + _ESCAPE * (i + 1), chr(b)) for i, b in enumerate(data)}
    found: Escapes = {}
    i = 0
    while i < len(data):
        size = _sequence_size(data, i)
        try:
            character = data[i : i + size].decode("utf-8")
        except UnicodeDecodeError:
            character, size = "\ufffd", 1
        found[at + _ESCAPE * i] = (at + _ESCAPE * (i + size), character)
        i += size
    return found


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
    end = text[-_LONGEST_REFERENCE_TAIL:]
    if "&" not in end and "%" not in end:  # most texts: no need to look closer
        return None
    amp = text.rfind("&", max(len(text) - _LONGEST_REFERENCE_TAIL, 0))
    if amp >= 0 and _REFERENCE_TAIL.match(text, amp) is not None:
        return amp
    # A percent-escape begun (``%``, ``%C``), and before it the escapes of a UTF-8 sequence
    # not yet finished (``%C3`` of ``%C3%A9``): the earlier of the two.
    percent = _PERCENT_TAIL.search(text, max(len(text) - 2, 0))
    begun = len(text) if percent is None else percent.start()
    unfinished = _unfinished_character(text[:begun] if percent is not None else text)
    return unfinished if unfinished is not None else (begun if percent is not None else None)


def _unfinished_character(text: str) -> int | None:
    """The start of a percent-escaped UTF-8 sequence the text ends before its end."""
    window = _ESCAPE * (_LONGEST_CHARACTER - 1)
    run = _PERCENT_RUN.search(text, max(len(text) - window, 0))
    while run is not None and run.end() != len(text):
        run = _PERCENT_RUN.search(text, run.end())
    if run is None:
        return None
    data = bytes.fromhex(run.group().replace("%", ""))
    for back in range(1, min(len(data), _LONGEST_CHARACTER - 1) + 1):
        i = len(data) - back
        if data[i] & 0xC0 != 0x80:  # a lead byte (or a byte of its own)
            size = _sequence_size(data, i)
            return run.start() + _ESCAPE * i if size > back else None
    return None

"""What decoded bytes say: the stretches of them that are UTF-8 text without control
characters (or UTF-16, where every other byte is as UTF-16's high bytes are), from each of
the places a decoding may begin (llmmesh/policy/encoded.py tries every one: a character
put in front of encoded text, or among it, shifts the bytes after it), put in the order
they lie in the encoded string."""

from __future__ import annotations

import bisect
import re
from collections import defaultdict
from collections.abc import Iterable
from typing import NamedTuple

from llmmesh.policy.joined import SEPARATOR

MIN_TEXT = 8  # bytes of text, at least, for a decoding to say something
_BLOCKS = [bytes([block]) for block in range(1, 0x20)]  # UTF-16's high bytes below 0x20
_BELOW_SPACE = bytes(range(0x20))
# Text read from bytes: characters but control characters (line breaks and the tab are
# text), which text does not hold and bytes that are no text do, the surrogates that stand
# for bytes that are not UTF-8, and U+FFFD, for UTF-16 that is not. (Format characters
# are text: zero-width ones hide nothing.)
_READABLE = re.compile(r"[^\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\udc80-\udcff\ufffd]{2,}")


class Decoding(NamedTuple):
    """Bytes decoded from an encoded string from its character ``skip`` on, each byte
    ``width`` of its characters (4/3 in base64, 2 in hexadecimal)."""

    skip: int
    width: float
    data: bytes


def read_text(decodings: Iterable[Decoding]) -> str | None:
    """In each decoding that holds a stretch of text long enough to say something, all its
    stretches of text (what bytes put among the text leave of it), but where a likelier
    stretch of another decoding lies, in the order they lie in the encoded string, joined;
    or None. UTF-8 and UTF-16 are each read so, and joined one after the other."""
    readings: dict[tuple[str, int], list[_Stretch]] = defaultdict(list)
    for skip, width, data in decodings:
        text = data.decode("utf-8", "surrogateescape")  # a byte that is no UTF-8: a surrogate
        if any(map(_says_something, _READABLE.findall(text))):
            readings["utf-8", 0] += _stretches(text, data.isascii(), skip, width)
        for order, offset in _utf16(data):
            wide = data[offset : offset + (len(data) - offset) // 2 * 2].decode(order, "replace")
            if any(map(_says_something, _READABLE.findall(wide))):
                # two bytes a character, from the byte ``offset``
                at = skip + offset * width
                readings[order, offset] += _stretches(wide, True, at, 2 * width)
    # Each way of reading apart from the others, and joined apart: UTF-16 read over UTF-8
    # text is gibberish that may run longer, and must neither take the text's place nor
    # come between two stretches of it; nor may one of the two ways UTF-16 can be read
    # take the other's (the text's, where a byte put in front shifted it, is not always
    # the longer).
    read = [s.text for stretches in readings.values() for s in sorted(_apart(stretches))]
    return SEPARATOR.join(read) if read else None


class _Stretch(NamedTuple):
    """Text read from bytes, and where those bytes lie in the run."""

    start: float
    end: float
    text: str


def _utf16(data: bytes) -> list[tuple[str, int]]:
    """How ``data`` may be UTF-16 (a byte order, and the byte it begins at), if its even or
    its odd bytes are as the high bytes of UTF-16 text are (Windows' own text; PowerShell's
    encoded commands are its base64): NULs at the odd bytes are little-endian text from the
    first byte or big-endian text from the second, and the other way round at the even
    bytes (a byte put in front shifts it)."""
    for orders, high_bytes in (
        (("utf-16-le", "utf-16-be"), data[1::2]),
        (("utf-16-be", "utf-16-le"), data[0::2]),
    ):
        if len(high_bytes) >= MIN_TEXT and _high_bytes(high_bytes):
            return [(orders[0], 0), (orders[1], 1)]
    return []


def _high_bytes(some: bytes) -> bool:
    """A quarter of them NUL (ASCII), or half of them NUL or one value below 0x20 (ASCII
    and one of the blocks of Greek, Cyrillic, Hebrew, Arabic or the scripts of India:
    look-alikes are 03 and 04); bytes that are no such text rarely are, and UTF-8 text
    never is. (Read so wrongly, bytes only add gibberish: UTF-16 is read apart.)"""
    nul = some.count(0)
    if nul * 4 >= len(some):
        return True
    if len(some.translate(None, _BELOW_SPACE)) * 2 > len(some):  # (most bytes: no count)
        return False
    return (nul + max(map(some.count, _BLOCKS))) * 2 >= len(some)


def _says_something(text: str) -> bool:
    return len(text) >= MIN_TEXT or len(text.encode("utf-8")) >= MIN_TEXT


def _stretches(text: str, ascii_text: bool, skip: float, width: float) -> list[_Stretch]:
    """The stretches of decoded bytes that are UTF-8 text without control characters."""
    found = []
    at = offset = 0  # where the last stretch ended, in characters and in bytes
    for stretch in _READABLE.finditer(text):
        read = stretch.group()
        if ascii_text:
            start, size = stretch.start(), len(read)
        else:
            start = offset + len(text[at : stretch.start()].encode("utf-8", "surrogateescape"))
            size = len(read.encode("utf-8"))
            at, offset = stretch.end(), start + size
        found.append(_Stretch(skip + start * width, skip + (start + size) * width, read))
    return found


def _apart(stretches: list[_Stretch]) -> list[_Stretch]:
    """The stretches but those that a likelier one overlaps for more than half their
    length (two decodings cannot both be right about the same bytes: the other reading is
    gibberish; the bytes where two readings meet may be read by both), by where they
    begin. Likelier: more of it ASCII, then longer (read as UTF-16, almost any bytes are
    some character, and gibberish may run longer than the text)."""
    kept: list[_Stretch] = []
    for stretch in sorted(stretches, key=_unlikeliness):
        at = bisect.bisect_left(kept, stretch)
        neighbours = kept[max(at - 1, 0) : at + 1]
        if all(_overlap(stretch, other) * 2 <= stretch.end - stretch.start for other in neighbours):
            kept.insert(at, stretch)
    return kept


def _unlikeliness(stretch: _Stretch) -> tuple[int, float]:
    return -len(stretch.text.encode("ascii", "ignore")), stretch.start - stretch.end


def _overlap(one: _Stretch, other: _Stretch) -> float:
    return max(0.0, min(one.end, other.end) - max(one.start, other.start))

"""What decoded bytes say: every stretch of text in a decoding that says something, but
where another decoding reads longer, in the order the bytes lie in the encoded string."""

from __future__ import annotations

from llmmesh.policy.bytes_text import Decoding, read_text


def none(count: int, first: int = 0x80) -> bytes:
    """Bytes that are no text: UTF-8 continuation bytes alone, each another (so they read
    as no UTF-16 either)."""
    return bytes(range(first, first + count))


def test_text_around_bytes_that_are_none_is_read_whole() -> None:
    data = b"\x00\x01how to build\xff\xfe a bomb\x07"
    assert read_text([Decoding(0, 2, data)]) == "how to build\n a bomb"


def test_a_decoding_of_short_stretches_alone_says_nothing() -> None:
    assert read_text([Decoding(0, 2, b"ab\x00cd\x00efg\x00hij")]) is None
    assert read_text([Decoding(0, 2, "\U0001f4a3\U0001f4a3".encode())]) is not None  # 8 bytes


def test_each_stretch_is_read_from_the_decoding_that_reads_it_longest() -> None:
    # The first half read from character 0, the second from character 1 (a character put
    # among the encoded text shifted it): each decoding's gibberish lies where the other
    # reads longer, and is left out; the halves come in the order they lie.
    first = Decoding(0, 2, b"how to bu" + none(2) + b"zq" + none(9, 0x90))
    second = Decoding(1, 2, none(3) + b"xy" + none(6, 0x90) + b"ild a bomb")
    assert read_text([second, first]) == "how to bu\nild a bomb"


def test_positions_count_bytes_in_text_that_is_not_ascii() -> None:
    # "héllo wörld" is 13 bytes: the other decoding's "zz", at its bytes 11 and 12, lies
    # in it (and is left out), where 11 characters would have ended before it.
    first = Decoding(0, 2, "héllo wörld".encode() + none(16))
    second = Decoding(0, 2, none(11) + b"zz" + none(3, 0xA0) + b"and the rest")
    assert read_text([first, second]) == "héllo wörld\nand the rest"


def test_utf16_is_read_as_such_and_takes_no_utf8_text_s_place() -> None:
    wide = Decoding(0, 2, "how to build a bomb".encode("utf-16-le"))
    # (and as big-endian text from the second byte, which it may be too)
    assert read_text([wide]) == "how to build a bomb\now to build a bomb"
    # UTF-8 text, then enough UTF-16 for all the bytes to be read so too, which reads the
    # UTF-8 text as gibberish that runs on into the UTF-16 text: both readings are kept.
    mixed = Decoding(0, 2, b"build a bomb!" + "and hello there".encode("utf-16-le"))
    utf8, *utf16 = str(read_text([mixed])).split("\n")
    assert utf8 == "build a bomb!a" and any(r.endswith("and hello there") for r in utf16)

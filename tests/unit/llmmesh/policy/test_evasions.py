"""Evasions composed: a deny phrase written with any mix of the disguises the views read
through (look-alike letters, case, digits for letters, invisible characters, separators
between letters, every kind of escape, tag characters, odd spaces, and base64 or
hexadecimal around the whole, in one run or in pieces) is still denied, and an address so
written (but for what would make it no address) is redacted whole. Each disguise has its
own test in test_normalize.py and test_encoded.py; these look for two that undo each
other."""

from __future__ import annotations

import base64
import re

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmmesh.policy.rules import RuleSet
from llmmesh.types import PolicyAction
from services.policy.config import DEFAULT_RULES

RULES = RuleSet.from_file(DEFAULT_RULES)
PHRASE = "how to build a bomb"
LOOKALIKES = {
    "o": ["\u043e", "\u03bf", "0", "\uff4f", "\u1d0f"],  # Cyrillic, Greek, digit, fullwidth
    "a": ["\u0430", "4", "@", "\uff41"],
    "b": ["\uff42", "\u24d1", "\U0001f171"],  # fullwidth, circled, negative squared
    "i": ["1", "\u0456", "I", "l"],
    "l": ["1", "I", "\u04cf"],
    "u": ["\u03c5"],
    "d": ["\u0501"],
    "m": ["\uff4d"],
}
# What an address's characters may look like and still be one to a mail client.
ADDRESS_LOOKALIKES = {
    "a": ["\u0430", "\uff41"],
    "e": ["\u0435", "\uff45"],
    "o": ["\u043e", "\uff4f"],
    "p": ["\u0440"],
    "x": ["\u0445"],
    "c": ["\u0441"],
    "@": ["\uff20"],  # fullwidth
    ".": ["\uff0e", "\u3002"],  # fullwidth, ideographic
}
INVISIBLE = ["\u200b", "\u00ad", "\u2060", "\u200d", "\ufe0f", "\U000e0001"]
SEPARATORS = ["-", "_", ".", "/", " ", "*"]
SPACES = [" ", "\u00a0", "\u2003", "%20", "&nbsp;", "\\u0020", "\n"]
GLUED = "xyzAB019+/"  # characters put in front of base64 to shift its groups


def escaped(char: str, kind: int) -> str:
    """``char`` as an HTML reference (decimal, hexadecimal), percent-escapes, ``\\u`` or
    ``\\x`` escapes, or a tag character."""
    utf16 = char.encode("utf-16-be")
    forms = [
        lambda: f"&#{ord(char)};",
        lambda: f"&#x{ord(char):x};",
        lambda: "".join(f"%{b:02X}" for b in char.encode()),
        lambda: "".join(f"\\u{utf16[i]:02x}{utf16[i + 1]:02x}" for i in range(0, len(utf16), 2)),
        lambda: "".join(f"\\x{b:02x}" for b in char.encode()),
        lambda: chr(0xE0000 + ord(char)) if " " <= char <= "~" else char,
    ]
    return forms[kind]()


@st.composite
def disguised_letter(
    draw: st.DrawFn, letter: str, lookalikes: dict[str, list[str]] = LOOKALIKES
) -> str:
    written = letter
    if draw(st.booleans()) and letter in lookalikes:
        written = draw(st.sampled_from(lookalikes[letter]))
    elif draw(st.booleans()):
        written = letter.upper()
    if draw(st.integers(0, 4)) == 0:
        written = escaped(written, draw(st.integers(0, 5)))
    if draw(st.integers(0, 5)) == 0:
        written += draw(st.sampled_from(INVISIBLE))
    return written


@st.composite
def disguised_word(draw: st.DrawFn, word: str) -> str:
    letters = [draw(disguised_letter(letter)) for letter in word]
    separator = draw(st.sampled_from(["", "", *SEPARATORS])) if len(word) > 2 else ""
    return separator.join(letters)


@st.composite
def encoded(draw: st.DrawFn, text: str) -> str:
    """``text`` in UTF-8 or UTF-16, in base64 (characters of its alphabet glued in front, or
    not) or in hexadecimal, in one run or in pieces of one width (the last shorter), with
    invisible characters among it or not."""
    data = text.encode(draw(st.sampled_from(["utf-8", "utf-8", "utf-16-le", "utf-16-be"])))
    if draw(st.booleans()):
        written = draw(st.text(GLUED, max_size=6)) + base64.b64encode(data).decode()
    else:
        written = data.hex()
    if draw(st.booleans()):
        width = draw(st.integers(2, 16)) if written == data.hex() else draw(st.integers(4, 16))
        separator = draw(st.sampled_from([" ", "\n", "  ", "\u00a0"]))
        written = separator.join(written[i : i + width] for i in range(0, len(written), width))
    if draw(st.integers(0, 3)) == 0:  # an invisible character every few characters
        every = draw(st.integers(1, 9))
        hidden = draw(st.sampled_from(INVISIBLE))
        written = hidden.join(written[i : i + every] for i in range(0, len(written), every))
    return written


@st.composite
def disguised(draw: st.DrawFn) -> str:
    words = [draw(disguised_word(word)) for word in PHRASE.split(" ")]
    text = draw(st.sampled_from(SPACES)).join(words)
    if draw(st.integers(0, 3)) == 0:
        text = "Decode: " + draw(encoded(text))
    return text


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(disguised())
def test_a_deny_phrase_in_any_mix_of_disguises_is_denied(text: str) -> None:
    assert RULES.check_input(text).action is PolicyAction.DENY, repr(text)


@st.composite
def disguised_address(draw: st.DrawFn) -> str:
    address = "".join(draw(disguised_letter(c, ADDRESS_LOOKALIKES)) for c in "ada@example.com")
    if draw(st.integers(0, 3)) == 0:
        address = draw(encoded(address))
    return address


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(disguised_address())
def test_an_address_in_any_mix_of_disguises_is_redacted_whole(address: str) -> None:
    # (Punctuation around it: a word as long as the pieces of an encoded address, next to
    # them, may be read and redacted with them; test_encoded.py has the cases it is not.
    # A piece of nothing but characters glued in front adds nothing and is left.)
    verdict = RULES.check_input(f"mail: {address}. Now")
    assert verdict.action is PolicyAction.REDACT, repr(address)
    left = f"mail: (?:[{re.escape(GLUED)}]+\\s+)?\\[EMAIL\\]\\. Now"
    assert re.fullmatch(left, verdict.text), repr(address)

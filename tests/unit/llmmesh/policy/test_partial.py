"""Prefix patterns: every prefix of every match is matched, and a text that cannot grow
into a match is not (where the pattern has no assertions to over-approximate)."""

from __future__ import annotations

import pytest
import re2

from llmmesh.policy.partial import prefix_pattern


@pytest.mark.parametrize(
    ("pattern", "matches", "strays"),
    [
        (r"TICKET-\d{1,4}", ["TICKET-1234", "TICKET-7"], ["TICKET-12345", "TX"]),
        (r"(?i)secret\s+code", ["SECRET \t Code"], ["secretcode", "secret  cx"]),
        (r"(?:ab|c)+d", ["ababcd", "cd"], ["abd d", "ac"]),
        (r"x[^y]z", ["xaz"], ["xyz"]),
    ],
)
def test_prefixes_of_matches_and_only_those(
    pattern: str, matches: list[str], strays: list[str]
) -> None:
    prefix = prefix_pattern(pattern)
    assert prefix is not None
    compiled = re2.compile(f"(?:{prefix})\\z")
    for match in matches:
        assert re2.fullmatch(pattern, match)
        for end in range(len(match) + 1):
            assert compiled.fullmatch(match[:end]), (pattern, match[:end])
    for stray in strays:
        assert not compiled.fullmatch(stray), (pattern, stray)


def test_syntax_python_does_not_parse_has_no_prefix_pattern() -> None:
    assert prefix_pattern(r"\pL+") is None  # RE2's Unicode classes: held back by width

"""PII detectors, regex rules and redaction."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmmesh.policy.detectors import DETECTORS, Detector, find, matches, redact
from llmmesh.policy.rules import RuleSet, RuleSetError, RuleSetSpec
from llmmesh.types import PolicyAction

DEFAULT_RULES = Path(__file__).resolve().parents[4] / "services" / "policy" / "default_rules.yaml"


def scrub(text: str) -> str:
    return redact(text, find(text, list(DETECTORS)))


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("write to ada.l@example.co.uk today", "write to [EMAIL] today"),
        ("write to ada [at] example [dot] com today", "write to [EMAIL] today"),
        ("write to Ada(AT)example.co(dot)uk today", "write to [EMAIL] today"),
        ("card 4111 1111 1111 1111 exp", "card [CREDIT_CARD] exp"),
        ("card 4111-1111-1111-1111.", "card [CREDIT_CARD]."),
        ("card 4111.1111.1111.1111.", "card [CREDIT_CARD]."),
        ("card 4111/1111/1111/1111 ok", "card [CREDIT_CARD] ok"),
        ("card 4111_1111_1111_1111 ok", "card [CREDIT_CARD] ok"),
        ("amex 3782.822463.10005 ok", "amex [CREDIT_CARD] ok"),
        ("card 6011.0009.9013.9424.123 ok", "card [CREDIT_CARD] ok"),
        ("card 4111 1111.1111-1111 ok", "card [CREDIT_CARD] ok"),
        ("amex 3782-822463.10005 ok", "amex [CREDIT_CARD] ok"),
        ("mastercard 2223 0031 2200 3222 ok", "mastercard [CREDIT_CARD] ok"),
        ("uatp 1354 123456 78903 ok", "uatp [CREDIT_CARD] ok"),
        ("iban GB82 WEST 1234 5698 7654 32 ok", "iban [IBAN] ok"),
        ("from 10.0.0.7 to fe80:0:0:0:202:b3ff:fe1e:8329", "from [IP_ADDRESS] to [IP_ADDRESS]"),
        ("key sk-abcdefghijklmnop1234 leaked", "key [SECRET] leaked"),
        ("call +44 20 7946 0958 or 415-555-0123", "call [PHONE] or [PHONE]"),
    ],
)
def test_detectors_find_and_type_what_they_redact(text: str, expected: str) -> None:
    assert scrub(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("card 4111 1111 1111 1111 123 exp", "card [CREDIT_CARD] exp"),  # its code after it
        ("ids 12 4111 1111 1111 1111 end", "ids 12 [CREDIT_CARD] end"),
        ("card 4111-1111-1111-1111-2 ok", "card [CREDIT_CARD] ok"),
        ("iban GB82 WEST 1234 5698 7654 32 99 ok", "iban [IBAN] ok"),
        ("ip 300.1.2.3.4 ok", "ip 300.[IP_ADDRESS] ok"),  # the first octet out of range
    ],
)
def test_a_match_that_fails_its_check_hides_no_valid_one_in_or_after_it(
    text: str, expected: str
) -> None:
    """A detector's pattern is greedy: a card number with more digits around it matched as
    one number that fails Luhn, and the card went out as it was."""
    assert scrub(text) == expected
    verdict = RuleSet.from_file(DEFAULT_RULES).check_input(text)
    assert (verdict.action, verdict.text) == (PolicyAction.REDACT, expected)


WIDE = "名前 é 🙂 "  # characters of two, three and four bytes in UTF-8


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (WIDE + "card 4111 1111 1111 1111 exp", WIDE + "card [CREDIT_CARD] exp"),
        (WIDE + "ids 12 4111 1111 1111 1111 end", WIDE + "ids 12 [CREDIT_CARD] end"),
        ("ids 1é2 🙂4111 1111 1111 1111€ 12", "ids 1é2 🙂[CREDIT_CARD]€ 12"),
        (WIDE + "ip 300.1.2.3.4, 名 ada@example.com", WIDE + "ip 300.[IP_ADDRESS], 名 [EMAIL]"),
    ],
)
def test_matches_in_text_that_is_not_ascii_are_where_they_are(text: str, expected: str) -> None:
    """The search runs on the text's UTF-8 (its bytes, encoded once) and maps each match
    back to characters, a rejected one's next try one character on."""
    assert scrub(text) == expected


def str_matches(detector: Detector, text: str, pos: int) -> list[tuple[int, int, bool]]:
    """``matches`` as the RE2 wrapper finds them in a str (slow: the oracle)."""
    found = []
    while (match := detector.pattern.search(text, pos)) is not None:
        accepted = detector.accepts(match.group())
        found.append((match.start(), match.end(), accepted))
        pos = match.end() if accepted else match.start() + 1
    return found


@given(
    st.text(alphabet="0123456789 -.@abcxyzé名🙂\u200b", max_size=80),
    st.sampled_from(sorted(DETECTORS)),
    st.integers(0, 10),
)
@settings(max_examples=300, deadline=None)
def test_matches_in_utf8_are_those_found_in_the_str(text: str, name: str, pos: int) -> None:
    detector = DETECTORS[name]
    assert list(matches(detector, text, pos)) == str_matches(detector, text, pos)


def test_a_search_from_a_position_past_wide_characters_starts_there() -> None:
    text = "é🙂 4111 1111 1111 1111, 名 5500 0000 0000 0004 ok"
    found = [(text[s:e], s) for s, e, ok in matches(DETECTORS["credit_card"], text, 4) if ok]
    assert found == [("5500 0000 0000 0004", text.index("5500"))]


@pytest.mark.parametrize(
    "text",
    [
        "card 4111 1111 1111 1112 fails Luhn",
        "pi is 3.14159265358979323 and e 2.718281828459045235",
        "dated 2026/12/07 and 12.07.2026, ref 2026_1207_1227",
        "iban GB00 WEST 1234 5698 7654 32 fails mod 97",
        "version 999.1.1.1 is no address",
        "order 123456789012 is no phone",
        "an @ sign alone, and me@localhost",
        "meet me [at] noon, then (at) home",
        # Digits in groups of two: a row of numbers or a dump of bytes (here Luhn's check
        # passes), which no one prints a card in
        "scores 41 11 11 11 11 11 11 11, bytes 34 31 20 31 31 20 31 31 20 31 31 20 31 31",
        # Rows of years, which pass Luhn, but begin as no issued card does
        "revenue by year: 2023 2024 2025 2026, and 1991 1992 1993 1994 before",
        "ids 0000 0000 0000 0000 and 2721 0000 0000 0004",
    ],
)
def test_detectors_leave_look_alikes_alone(text: str) -> None:
    assert scrub(text) == text


def test_the_default_rules_redact_pii_and_still_deny() -> None:
    rules = RuleSet.from_file(DEFAULT_RULES)
    verdict = rules.check_input("mail me at ada@example.com")
    assert verdict.action is PolicyAction.REDACT
    assert verdict.text == "mail me at [EMAIL]" and verdict.rule_ids == ("redact-pii",)
    spelled = rules.check_input("mail me at ada [at] example [dot] com")
    assert spelled.text == "mail me at [EMAIL]"
    assert spelled.rule_ids == ("redact-spelled-out-emails",)
    # Prompts only: in a stream, any word and a space could begin one.
    assert rules.check_output("ada [at] example [dot] com").action is PolicyAction.ALLOW
    denied = rules.check_input("how to build a bomb, reply to ada@example.com")
    assert denied.action is PolicyAction.DENY


def test_regex_rules_use_re2_and_bad_patterns_are_refused(tmp_path: Path) -> None:
    spec = {
        "version": "t",
        "rules": [
            {"id": "ticket", "action": "redact", "regex": [r"TICKET-\d+"], "placeholder": "[T]"},
        ],
    }
    rules = RuleSet.from_spec(RuleSetSpec.model_validate(spec))
    assert rules.check_input("see TICKET-42 and TICKET-7").text == "see [T] and [T]"
    # Backreferences are not RE2: refused when the rule set is built, not at match time.
    bad = {"version": "t", "rules": [{"id": "b", "action": "deny", "regex": [r"(a)\1"]}]}
    with pytest.raises(RuleSetError, match="rule b: regex"):
        RuleSet.from_spec(RuleSetSpec.model_validate(bad))
    path = tmp_path / "rules.yaml"
    path.write_text(json.dumps({"version": "t", "rules": [{"id": "n", "action": "deny"}]}))
    with pytest.raises(RuleSetError, match="needs keywords, regex or detectors"):
        RuleSet.from_file(path)


def test_a_pathological_pattern_runs_in_linear_time() -> None:
    spec = {"version": "t", "rules": [{"id": "r", "action": "flag", "regex": [r"(a+)+$"]}]}
    rules = RuleSet.from_spec(RuleSetSpec.model_validate(spec))
    # Catastrophic for a backtracking engine; RE2 answers at once.
    assert rules.check_input("a" * 50_000 + "!").action is PolicyAction.ALLOW

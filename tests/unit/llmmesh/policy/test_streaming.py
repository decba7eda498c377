"""The streamed output check: any split of a text gives exactly the one-shot check of the
whole, only a possible match's tail is held back, and a deny rule stops the stream."""

from __future__ import annotations

import pytest
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from llmmesh.policy import RuleLibrary
from llmmesh.policy.matching import Views
from llmmesh.policy.rules import RuleSet, RuleSetError, RuleSetSpec
from llmmesh.policy.schema import SCHEMA_VERSION, dump_rules, load_rules
from llmmesh.policy.streaming import OutputScanner
from llmmesh.types import PolicyAction
from services.policy.config import DEFAULT_RULES


def output_rules() -> RuleSet:
    """The default set applied to output too, plus a keyword phrase, a regex and a
    deny rule."""
    doc = yaml.safe_load(DEFAULT_RULES.read_text())
    for rule in doc["rules"]:
        rule["stage"] = "both"
    doc["rules"] += [
        {"id": "ticket", "stage": "output", "action": "redact", "regex": [r"TICKET-\d{1,4}\b"]},
        {"id": "code", "stage": "output", "action": "redact", "regex": [r"(?i)\bcode\s+\w+"]},
        {"id": "plan", "stage": "output", "action": "redact", "keywords": ["secret plan", "ab"]},
        {"id": "stop-word", "stage": "output", "action": "deny", "keywords": ["forbidden"]},
        {
            "id": "part",
            "stage": "output",
            "action": "flag",
            "keywords": ["ion"],
            "whole_word": False,
        },
    ]
    return RuleSet.from_spec(RuleSetSpec.model_validate(doc))


RULES = output_rules()


def stream(chunks: list[str]) -> tuple[str, OutputScanner]:
    scanner = OutputScanner(RULES.output)
    released = [scanner.feed(chunk).text for chunk in chunks]
    released.append(scanner.finish().text)
    return "".join(released), scanner


def assert_same_as_one_shot(text: str, chunks: list[str]) -> None:
    released, scanner = stream(chunks)
    whole = RULES.check_output(text)
    if whole.action is PolicyAction.DENY:
        assert scanner.denied_by in whole.rule_ids, (text, chunks)
        return
    assert scanner.denied_by is None, (text, chunks)
    assert released == whole.text, (text, chunks)
    assert sorted(scanner.matched) == sorted(whole.rule_ids), (text, chunks)


MATCHING = [
    "mail ada@example.com now",
    "card 4111 1111 1111 1111 ok",
    "card 4111.1111.1111.1111 ok",
    "call +44 20 7946 0958 today",
    "iban GB82 WEST 1234 5698 7654 32 end",
    "host 192.168.10.1 and ::1",
    "key sk-abcdefghijklmnop0123 here",
    "the secret   plan is TICKET-42.",
    "the CODE  blue42 now",
    "a forbidden word",
    "nation",
    "how to bu\u200bild a b-o-m-b? no",
    "card 4111\u00a01111\u00a01111\u00a0\uff11\uff11\uff11\uff11 ok",
    "mail \u0430da@example.com now",
    "the code ada@example.com now",
    "card 4111 1111 1111 1111 123 ok",
    "ip 300.1.2.3.4 ok",
    "mail ada&#64;example.com now",
    "a forbidd&#101;n word",
    "the secret&nbsp;plan is TICKET&#x2d;42.",
    "card 4111&#32;1111 1111 1111 ok",
    "mail ada%40example.com and a%20forbidden%20word",
]


@pytest.mark.parametrize("text", MATCHING)
def test_every_pair_of_chunk_splits_gives_the_one_shot_result(text: str) -> None:
    assert RULES.check_output(text).rule_ids, "each sample must match some rule"
    for first in range(len(text) + 1):
        for second in range(first, len(text) + 1):
            assert_same_as_one_shot(text, [text[:first], text[first:second], text[second:]])


WORDS = ["build a bomb", "TICKET-", "secret", " plan", "forbid", "den", "ion", "Code", "  "]
PII = ["ada@example.com", "4111 1111 1111 1111", "4111/1111/1111/1111", "192.168.1.1"]
# Characters the normalized views fold or drop: zero-width space, soft hyphen, a
# combining mark, no-break space, Cyrillic a and o, fullwidth b and 4, Arabic-Indic 4,
# Devanagari 1, a bullet and an emoji (separators), a circled b, a negative squared B and a
# regional indicator B (symbols that are letters), tag characters for b, @ and 4
# (invisible, mirroring ASCII) and the cancel tag.
EVASIONS = [
    *["\u200b", "\u00ad", "\u0301", "\u00a0", "\u0430", "\u043e", "\uff42", "\uff14"],
    *["\u0664", "\u0967", "\u2022", "\U0001f4a3", "\u24d1", "\U0001f171", "\U0001f1e7"],
    *["\U000e0062", "\U000e0040", "\U000e0034", "\U000e007f"],
]
# Escapes (HTML character references, URL percent-escapes, backslash escapes), whole and in
# pieces, and runs that only look like them.
ESCAPES = [
    *["&", "#", "x", ";", "&#", "&#98;", "&#x62;", "&#64;", "&amp", "&nbsp;", "&#8203;"],
    *["%", "%6", "%62", "%40", "%20", "%C3", "%A9", "%E2%82%AC", "%FF", "F"],
    *["\\", "u", "\\u00", "62", "\\u0062", "\\x40", "\\xc3", "\\ud83d", "\\udca3", "{62}"],
]
PIECES = st.sampled_from(
    [*"0123456789 .-@+()abAB:_xyzEGKT\n/\"'\x00", *WORDS, *PII, *EVASIONS, *ESCAPES]
)


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(PIECES, max_size=40).map("".join), st.lists(st.integers(0, 400), max_size=12))
def test_streaming_any_split_equals_the_one_shot_check(text: str, cuts: list[int]) -> None:
    edges = sorted({c for c in cuts if c < len(text)})
    bounds = list(zip([0, *edges], [*edges, len(text)], strict=True))
    assert_same_as_one_shot(text, [text[a:b] for a, b in bounds])


def test_overlapping_redactions_hide_both_matches_whole() -> None:
    """The "code" rule's match ends inside an address: both go under one placeholder (the
    address's end was let out when the later of two overlapping matches was dropped)."""
    text = "the code ada@example.com now"
    assert RULES.check_output(text).text == "the [REDACTED] now"
    for cut in range(len(text) + 1):
        assert stream([text[:cut], text[cut:]])[0] == "the [REDACTED] now", cut


def with_lead(lead: str, chunks: list[str]) -> tuple[str, OutputScanner, list[int]]:
    """The output released after ``lead`` (text it continues), and each step's held."""
    scanner = OutputScanner(RULES.output, lead)
    steps = [scanner.feed(chunk) for chunk in chunks]
    steps.append(scanner.finish())
    return "".join(s.text for s in steps), scanner, [s.held for s in steps]


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    st.lists(PIECES, min_size=1, max_size=30).map("".join),
    st.integers(0, 400),
    st.lists(st.integers(0, 400), max_size=8),
)
@example(text="ada@example.comada@example.com", at=18, cuts=[])
@example(text="04111 1111 1111 11114111 1111 1111 1111", at=1, cuts=[7])
@example(text="x\u200bab cd", at=1, cuts=[1])
@example(text="0000 build a bomb ", at=4, cuts=[1])
def test_a_lead_only_adds_matches_and_is_never_released(
    text: str, at: int, cuts: list[int]
) -> None:
    """The output is checked as without the lead, and a match the lead begins and the
    output ends decides too: the same denial or more, the same rules or more, and where
    no match spans the lead's end, the same text out."""
    lead, output = text[: at % (len(text) + 1)], text[at % (len(text) + 1) :]
    edges = sorted({c for c in cuts if c < len(output)})
    chunks = [output[a:b] for a, b in zip([0, *edges], [*edges, len(output)], strict=True)]
    released, scanner, held = with_lead(lead, chunks)
    without, alone, _ = with_lead("", chunks)
    if alone.denied_by is not None:
        assert scanner.denied_by is not None, (lead, output)
    elif scanner.denied_by is None:  # a denial stops the reading: later rules go unread
        assert set(alone.matched) <= set(scanner.matched), (lead, output)
    spanning = RULES.output.matcher.spanning(Views(text), len(lead))  # overlapping ones too
    if not spanning and alone.denied_by is not None:
        # The same denial; a tail held while the lead's end might still begin a match
        # (digits after digits) is never released once the stream is denied.
        assert scanner.denied_by == alone.denied_by, (lead, output)
        assert without.startswith(released), (lead, output)
    elif not spanning:
        assert (released, scanner.denied_by) == (without, alone.denied_by), (lead, output)
    if scanner.denied_by is None:  # what the output alone hides stays hidden
        hidden = [output[h.start : h.end] for h in RULES.output.matcher.hits(output) if h.valid]
        assert all(secret in without for secret in hidden if secret in released)
    if scanner.denied_by is None:
        assert all(0 <= h <= len(output) for h in held) and held[-1] == 0


def test_a_match_begun_in_the_lead_is_denied_or_redacted_in_the_output() -> None:
    released, scanner, _ = with_lead("Sure: this is forbid", ["den", " now"])
    assert (released, scanner.denied_by) == ("", "stop-word")
    released, scanner, _ = with_lead("the secret", [" plan is", " ready"])
    assert released == "[REDACTED] is ready" and scanner.matched == ["plan"]
    released, scanner, _ = with_lead("mail ada@exa", ["mple.com", " ok"])
    assert released == "[EMAIL] ok"
    released, scanner, _ = with_lead("the secret plan", [" is ready"])  # the lead's own match
    assert (released, scanner.matched) == (" is ready", [])
    # A letter glued before the output's first word hides none of its own matches.
    released, _, _ = with_lead("x", ["ab cd"])
    assert released == "[REDACTED] cd"
    long_lead = "x" * 5000 + " the secret"  # only its end counts, as in a stream
    released, _, _ = with_lead(long_lead, [" plan is", " ready"])
    assert released == "[REDACTED] is ready"


def test_a_match_of_the_leads_own_hides_no_match_that_spans_its_end() -> None:
    """A regular expression's matches do not overlap: "code code" of the lead would hide
    "code blue", which the lead begins and the output ends."""
    released, scanner, _ = with_lead("the code code ", ["blue", " sky"])
    assert (released, scanner.matched) == ("[REDACTED] sky", ["code"])
    released, _, _ = with_lead("the code code", [" blue sky"])
    assert released == "[REDACTED] sky"  # the match's part in the output: " blue"


def test_only_a_possible_match_is_held_back() -> None:
    scanner = OutputScanner(RuleSet.from_file(DEFAULT_RULES).output)  # detectors only
    assert scanner.feed("Hello, world. Write to ").text == "Hello, world. Write to "
    step = scanner.feed("ada@exam")
    assert (step.text, step.held) == ("", len("ada@exam"))
    step = scanner.feed("ple.com, thanks")
    assert step.text == "[EMAIL], " and step.redacted
    assert scanner.finish().text == "thanks"


def test_text_past_ascii_is_held_and_cut_at_its_own_characters() -> None:
    # Rules that opt out of normalization match the text itself: with characters of two
    # and three bytes before and inside a held tail, positions must stay in characters.
    doc = yaml.safe_load(DEFAULT_RULES.read_text())
    for rule in doc["rules"]:
        rule["normalize"] = False
    raw = RuleSet.from_spec(RuleSetSpec.model_validate(doc))
    text = "\u00e9t\u00e9 \u2014 \u0430da@example.com, caf\u00e9 ada@ex\u00e4mple.com"
    whole = raw.check_output(text).text
    assert whole == "\u00e9t\u00e9 \u2014 \u0430[EMAIL], caf\u00e9 ada@ex\u00e4mple.com"
    for cut in range(len(text) + 1):
        scanner = OutputScanner(raw.output)
        released = scanner.feed(text[:cut]).text + scanner.feed(text[cut:]).text
        assert released + scanner.finish().text == whole, cut


def test_a_deny_rule_stops_the_stream_and_nothing_more_is_released() -> None:
    scanner = OutputScanner(RULES.output)
    released = scanner.feed("this is forbid").text + scanner.feed("den, truly").text
    assert scanner.denied_by == "stop-word"
    assert "forbid" not in released
    assert scanner.feed(" more text").text == ""
    assert scanner.finish().denied_by == "stop-word"


@pytest.mark.parametrize(
    "text",
    ["a bomb%62 x", "a bomb%20 x", "a bomb&#98; x", "a bomb&#32; x", "a bomb\\u0062 x"],
)
def test_no_deny_is_decided_on_an_escape_still_being_written(text: str) -> None:
    """A certain deny match stops a stream while held back, unless an escape still being
    written follows it: that may read as a letter that undoes the match (``bomb%62`` reads
    ``bombb``). Every split gives the whole text's decision."""
    rules = RuleSet.from_text(
        'version: v\nrules:\n  - {id: d, stage: output, action: deny, regex: ["\\\\bbomb\\\\b"]}\n',
        "t",
    )
    denied = rules.check_output(text).action is PolicyAction.DENY
    for first in range(len(text) + 1):
        for second in range(first, len(text) + 1):
            scanner = OutputScanner(rules.output)
            for chunk in (text[:first], text[first:second], text[second:]):
                scanner.feed(chunk)
            scanner.finish()
            assert (scanner.denied_by is not None) == denied, (text, first, second)


def test_work_per_chunk_does_not_grow_with_the_stream() -> None:
    rules = RuleSet.from_text(
        "version: v\nrules:\n  - {id: r, stage: output, action: redact, regex: ['x\\w*y']}\n",
        "test",
    )
    scanner = OutputScanner(rules.output)
    held = [scanner.feed("x" + "a" * 50).held for _ in range(200)]
    # An unbounded regex is held back up to the cap only: what each chunk rescans stays
    # bounded however long the stream is.
    assert max(held) <= rules.output.matcher.holdback_cap + 51


def test_re2_refuses_backtracking_patterns_with_a_clear_error() -> None:
    for pattern, reason in [
        (r"(a)\1", "not valid RE2 syntax: invalid escape sequence"),
        (r"(?=a)b", "not valid RE2 syntax: invalid perl operator"),
        (r"a*", "matches the empty string"),
    ]:
        doc = f"version: v\nrules:\n  - {{id: bad, action: deny, regex: ['{pattern}']}}\n"
        with pytest.raises(RuleSetError, match=rf"rule bad: .*{reason}"):
            RuleSet.from_text(doc, "test")


def test_keywords_can_match_inside_words_when_asked() -> None:
    assert RULES.check_output("the nation").rule_ids == ("part",)
    assert RULES.check_output("an abacus").rule_ids == ()  # "ab" is whole-word only


def capped(tokens: int | None) -> RuleSet:
    """The default set on output, holding no text back for more than ``tokens`` tokens."""
    doc = yaml.safe_load(DEFAULT_RULES.read_text())
    for rule in doc["rules"]:
        rule["stage"] = "both"
    return RuleSet.from_spec(RuleSetSpec.model_validate({**doc, "output_holdback_tokens": tokens}))


# Minified output: one run with no whitespace, which the detectors' partial forms (an
# address's local part, a key) may extend, so nothing of it settles until it ends.
RUN = "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIiwibmFtZSI6IkpvaG4ifQ.SflKxwRJSMeKKF2QT4"


def test_without_a_cap_a_long_run_is_held_until_it_ends() -> None:
    scanner = OutputScanner(capped(None).output)
    released = [scanner.feed(c).text for c in RUN]
    assert "".join(released) == ""  # held: it could still become a key or an address
    assert scanner.finish().text == RUN


@pytest.mark.parametrize("limit", [1, 3, 8])
def test_the_token_cap_bounds_how_long_any_text_is_held(limit: int) -> None:
    scanner = OutputScanner(capped(limit).output)
    out = ""
    for fed, char in enumerate(RUN, start=1):  # one character per token
        out += scanner.feed(char, tokens=1).text
        assert fed - len(out) <= limit, "text held for more tokens than the cap"
    out += scanner.finish().text
    assert out == RUN


def test_a_match_within_the_cap_is_redacted_and_one_beyond_it_goes_out() -> None:
    text = "mail jo@example.org now"
    whole = OutputScanner(capped(64).output)
    released = "".join(whole.feed(c).text for c in text) + whole.finish().text
    assert released == "mail [EMAIL] now"
    tight = OutputScanner(capped(2).output)
    released = "".join(tight.feed(c).text for c in text) + tight.finish().text
    assert "jo@" in released  # its start went out before the address showed whole


def test_a_derived_set_inherits_the_cap_unless_it_sets_its_own() -> None:
    library = RuleLibrary()
    base = (
        "version: b1\noutput_holdback_tokens: 6\nrules: [{id: k, action: deny, keywords: [zap]}]\n"
    )
    library.load(
        {
            "default": base,
            "inherits": "version: i1\nextends: default\nrules: []\n",
            "own": "version: o1\nextends: default\noutput_holdback_tokens: 2\nrules: []\n",
        },
        "test",
    )
    assert library.get("").holdback_tokens == 6
    assert library.get("inherits").holdback_tokens == 6
    assert library.get("own").holdback_tokens == 2
    rules = library.get("own")
    loaded = load_rules(dump_rules(rules), rules.version, 256, SCHEMA_VERSION, 2)
    assert loaded.output.holdback_tokens == 2

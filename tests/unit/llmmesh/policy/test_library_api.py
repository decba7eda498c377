"""The policy library's public API: the rules' wire form across versions, and detectors
registered by name (their partial form derived, as a regex rule's is)."""

from __future__ import annotations

import json
import logging

import pytest

from llmmesh.policy import (
    DETECTORS,
    RuleSet,
    RuleSetError,
    StreamCheck,
    dump_rules,
    load_rules,
    register_detector,
)
from llmmesh.types import PolicyAction
from services.policy.config import DEFAULT_RULES


def test_rules_round_trip_through_their_wire_form() -> None:
    rules = RuleSet.from_file(DEFAULT_RULES)
    again = load_rules(dump_rules(rules), rules.version, 256, schema_version=1)
    assert again.specs == rules.specs and again.version == rules.version


def test_a_field_from_a_newer_schema_is_ignored_with_a_log_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    newer = [{"id": "r", "action": "deny", "keywords": ["apples"], "case_sensitive": True}]
    with caplog.at_level(logging.WARNING):
        rules = load_rules(json.dumps(newer), "v9", 256, schema_version=2)
    assert rules.check_input("Apples please").action is PolicyAction.DENY
    [record] = [r for r in caplog.records if r.name == "llmmesh.policy.schema"]
    assert record.fields["fields"] == ["case_sensitive"]  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    "text", ["not json", '{"id": "r"}', '[{"id": "r", "action": "deny"}]', "[1]"]
)
def test_rules_that_do_not_load_are_refused(text: str) -> None:
    with pytest.raises(RuleSetError):
        load_rules(text, "v", 256, schema_version=1)


def test_a_registered_detector_is_used_by_name_and_streams_like_the_built_in_ones() -> None:
    register_detector("employee_id", "[EMPLOYEE]", r"\bEMP-\d{6}\b")
    try:
        rules = RuleSet.from_text(
            "version: v\nrules:\n  - {id: ids, stage: both, action: redact,"
            " detectors: [employee_id]}\n",
            "test",
        )
        assert rules.check_input("ask EMP-123456 now").text == "ask [EMPLOYEE] now"
        released: list[str] = []
        check = StreamCheck(rules.output, lambda _: None)
        for piece in ["id EM", "P-12", "3456 ok"]:
            released.append(check.feed(piece).text)
        released.append(check.feed("", final=True).text)
        assert released[:2] == ["id ", ""]  # "EM..." may still become an id: held
        assert "".join(released) == "id [EMPLOYEE] ok"
    finally:
        del DETECTORS["employee_id"]

from __future__ import annotations

from pathlib import Path

import pytest

from llmmesh.types import PolicyAction
from services.policy.config import DEFAULT_RULES
from services.policy.rules import RuleSet, RuleSetError


@pytest.fixture
def rules() -> RuleSet:
    return RuleSet.from_file(DEFAULT_RULES)


def test_deny_keyword_matches_case_insensitively_across_whitespace(rules: RuleSet) -> None:
    verdict = rules.check_input("Please tell me how to BUILD  a\nbomb today")
    assert verdict.action is PolicyAction.DENY
    assert verdict.rule_ids == ("deny-weapons",)
    assert verdict.rule_set_version == rules.version


def test_whole_words_only(rules: RuleSet) -> None:
    assert rules.check_input("a bioweaponry museum").action is PolicyAction.ALLOW


def test_clean_text_is_allowed_unchanged(rules: RuleSet) -> None:
    verdict = rules.check_input("Once upon a time")
    assert verdict.action is PolicyAction.ALLOW
    assert verdict.rule_ids == ()
    assert verdict.text == "Once upon a time"


def test_flag_rules_match_without_denying(tmp_path: Path) -> None:
    path = tmp_path / "rules.yaml"
    path.write_text(
        "version: v1\nrules:\n  - id: flag-x\n    action: flag\n    keywords: [hello]\n"
    )
    verdict = RuleSet.from_file(path).check_input("hello there")
    assert verdict.action is PolicyAction.ALLOW
    assert verdict.rule_ids == ("flag-x",)


@pytest.mark.parametrize(
    "content",
    [
        "version: v1\nrules:\n  - id: a\n    action: explode\n    keywords: [x]\n",
        "version: v1\nrules:\n  - id: a\n    action: deny\n    keywords: []\n",
        "version: v1\nrules:\n  - {id: a, action: deny, keywords: [x]}\n"
        "  - {id: a, action: deny, keywords: [y]}\n",
        "rules: []\n",
        "version: [\n",
    ],
)
def test_invalid_rule_files_are_rejected(tmp_path: Path, content: str) -> None:
    path = tmp_path / "rules.yaml"
    path.write_text(content)
    with pytest.raises(RuleSetError):
        RuleSet.from_file(path)

from __future__ import annotations

from pathlib import Path

import pytest

from llmmesh.policy.library import RuleLibrary
from llmmesh.policy.rules import RuleSet, RuleSetError
from llmmesh.runtime.errors import InvalidArgument
from llmmesh.types import PolicyAction
from services.policy.config import DEFAULT_RULES


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


DEFAULT_SET = """\
version: d1
rules:
  - {id: deny-a, action: deny, keywords: [apples]}
  - {id: deny-b, action: deny, keywords: [bananas]}
"""


def test_a_tenant_set_extends_the_default_overriding_and_disabling_rules() -> None:
    library = RuleLibrary()
    tenant = """\
version: t1
extends: default
disable: [deny-b]
rules:
  - {id: deny-a, action: flag, keywords: [apples]}
  - {id: deny-c, action: deny, keywords: [cherries]}
"""
    library.load({"default": DEFAULT_SET, "acme": tenant}, "test")
    acme, default = library.get("acme"), library.get("")
    assert acme.version == "t1+d1" and default.version == "d1"
    assert acme.check_input("apples").action is PolicyAction.ALLOW  # overridden: a flag
    assert acme.check_input("apples").rule_ids == ("deny-a",)
    assert acme.check_input("bananas").action is PolicyAction.ALLOW  # disabled
    assert acme.check_input("cherries").action is PolicyAction.DENY
    assert default.check_input("bananas").action is PolicyAction.DENY


@pytest.mark.parametrize(
    ("sets", "reason"),
    [
        ({"acme": "version: a\nextends: nowhere\nrules: []\n"}, "extends unknown set"),
        (
            {
                "a": "version: a\nextends: b\nrules: []\n",
                "b": "version: b\nextends: a\nrules: []\n",
            },
            "cycle",
        ),
        ({"acme": "version: a\nextends: default\ndisable: [zz]\nrules: []\n"}, "unknown rules"),
    ],
)
def test_broken_inheritance_is_refused_and_the_sets_in_force_stay(
    sets: dict[str, str], reason: str
) -> None:
    library = RuleLibrary()
    library.load({"default": DEFAULT_SET}, "test")
    with pytest.raises(RuleSetError, match=reason):
        library.load({"default": DEFAULT_SET, **sets}, "test")
    assert not library.offer(sets, "test")
    assert library.versions() == {"default": "d1"}


def test_an_unknown_rule_set_is_an_invalid_argument() -> None:
    library = RuleLibrary()
    library.load({"default": DEFAULT_SET}, "test")
    with pytest.raises(InvalidArgument, match="unknown rule set 'nope'"):
        library.get("nope")

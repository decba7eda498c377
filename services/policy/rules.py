"""Rule sets: loading and validating YAML, and matching text against them."""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from llmmesh.types import PolicyAction, Verdict


class Stage(enum.Enum):
    INPUT = "input"
    OUTPUT = "output"
    BOTH = "both"


class RuleAction(enum.Enum):
    DENY = "deny"
    FLAG = "flag"


class RuleSpec(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    id: str = Field(pattern=r"^[a-z0-9][a-z0-9_.-]*$")
    description: str = ""
    stage: Stage = Stage.INPUT
    action: RuleAction
    keywords: list[str] = Field(min_length=1)

    @field_validator("keywords")
    @classmethod
    def _non_blank(cls, value: list[str]) -> list[str]:
        if any(not k.strip() for k in value):
            raise ValueError("keywords must not be blank")
        return value


class RuleSetSpec(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    version: str = Field(min_length=1)
    rules: list[RuleSpec]


class RuleSetError(ValueError):
    """A rule file is invalid; the message says where."""


@dataclass(frozen=True)
class _CompiledRule:
    spec: RuleSpec
    pattern: re.Pattern[str]

    def applies_to_input(self) -> bool:
        return self.spec.stage in (Stage.INPUT, Stage.BOTH)


class RuleSet:
    def __init__(self, spec: RuleSetSpec) -> None:
        ids = [r.id for r in spec.rules]
        duplicates = sorted({i for i in ids if ids.count(i) > 1})
        if duplicates:
            raise RuleSetError(f"duplicate rule ids: {duplicates}")
        self.version = spec.version
        self._rules = [_CompiledRule(r, _keyword_pattern(r.keywords)) for r in spec.rules]

    @classmethod
    def from_file(cls, path: Path) -> RuleSet:
        try:
            doc: Any = yaml.safe_load(path.read_text(encoding="utf-8"))
            return cls(RuleSetSpec.model_validate(doc))
        except (OSError, yaml.YAMLError) as exc:
            raise RuleSetError(f"cannot read rule file {path}: {exc}") from None
        except ValidationError as exc:
            raise RuleSetError(f"invalid rule file {path}: {exc}") from None

    def check_input(self, text: str) -> Verdict:
        matched = [r for r in self._rules if r.applies_to_input() and r.pattern.search(text)]
        denied = any(r.spec.action is RuleAction.DENY for r in matched)
        return Verdict(
            action=PolicyAction.DENY if denied else PolicyAction.ALLOW,
            rule_ids=tuple(r.spec.id for r in matched),
            text=text,
            rule_set_version=self.version,
        )


def _keyword_pattern(keywords: list[str]) -> re.Pattern[str]:
    # Whitespace inside a phrase matches any run of whitespace; \b keeps words whole.
    phrases = (r"\s+".join(re.escape(w) for w in k.split()) for k in keywords)
    return re.compile(r"\b(?:" + "|".join(phrases) + r")\b", re.IGNORECASE)

"""Rule sets: loading and validating YAML, and matching text against them."""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import re2
import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from llmmesh.types import PolicyAction, Verdict
from services.policy.detectors import DETECTORS, disjoint, find, redact


class Stage(enum.Enum):
    INPUT = "input"
    OUTPUT = "output"
    BOTH = "both"


class RuleAction(enum.Enum):
    DENY = "deny"
    REDACT = "redact"  # matches are replaced by typed placeholders such as [EMAIL]
    FLAG = "flag"


class RuleSpec(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    id: str = Field(pattern=r"^[a-z0-9][a-z0-9_.-]*$")
    description: str = ""
    stage: Stage = Stage.INPUT
    action: RuleAction
    # Matchers (at least one kind): whole-word keywords, case-insensitive; RE2 regular
    # expressions; built-in detectors (services/policy/detectors.py).
    keywords: list[str] = Field(default_factory=list)
    regex: list[str] = Field(default_factory=list)
    detectors: list[str] = Field(default_factory=list)
    placeholder: str = "[REDACTED]"  # for keyword and regex matches of a redact rule

    @field_validator("keywords", "regex")
    @classmethod
    def _non_blank(cls, value: list[str]) -> list[str]:
        if any(not k.strip() for k in value):
            raise ValueError("must not be blank")
        return value

    @field_validator("detectors")
    @classmethod
    def _known(cls, value: list[str]) -> list[str]:
        unknown = sorted(set(value) - set(DETECTORS))
        if unknown:
            raise ValueError(f"unknown detectors {unknown}; known: {sorted(DETECTORS)}")
        return value

    @model_validator(mode="after")
    def _has_a_matcher(self) -> RuleSpec:
        if not (self.keywords or self.regex or self.detectors):
            raise ValueError("a rule needs keywords, regex or detectors")
        return self


class RuleSetSpec(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    version: str = Field(min_length=1)
    rules: list[RuleSpec]


class RuleSetError(ValueError):
    """A rule file is invalid; the message says where."""


@dataclass(frozen=True)
class _CompiledRule:
    spec: RuleSpec
    patterns: tuple[Any, ...]  # RE2 patterns: keywords and regex

    def applies_to_input(self) -> bool:
        return self.spec.stage in (Stage.INPUT, Stage.BOTH)

    def spans(self, text: str) -> list[tuple[int, int, str]]:
        found = [
            (m.start(), m.end(), self.spec.placeholder)
            for pattern in self.patterns
            for m in pattern.finditer(text)
        ]
        return found + find(text, self.spec.detectors)


class RuleSet:
    def __init__(self, spec: RuleSetSpec) -> None:
        ids = [r.id for r in spec.rules]
        duplicates = sorted({i for i in ids if ids.count(i) > 1})
        if duplicates:
            raise RuleSetError(f"duplicate rule ids: {duplicates}")
        self.version = spec.version
        self._rules = [_CompiledRule(r, _compile(r)) for r in spec.rules]

    @classmethod
    def from_file(cls, path: Path) -> RuleSet:
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise RuleSetError(f"cannot read rule file {path}: {exc}") from None
        return cls.from_text(text, str(path))

    @classmethod
    def from_text(cls, text: str, source: str) -> RuleSet:
        try:
            doc: Any = yaml.safe_load(text)
            return cls(RuleSetSpec.model_validate(doc))
        except yaml.YAMLError as exc:
            raise RuleSetError(f"cannot read rule file {source}: {exc}") from None
        except ValidationError as exc:
            raise RuleSetError(f"invalid rule file {source}: {exc}") from None

    def check_input(self, text: str) -> Verdict:
        """Deny wins; otherwise redact rules replace what they match; flags only report."""
        matched: list[str] = []
        action, redactions = PolicyAction.ALLOW, []
        for rule in (r for r in self._rules if r.applies_to_input()):
            spans = rule.spans(text)
            if not spans:
                continue
            matched.append(rule.spec.id)
            if rule.spec.action is RuleAction.DENY:
                action = PolicyAction.DENY
            elif rule.spec.action is RuleAction.REDACT:
                redactions += spans
        if action is not PolicyAction.DENY and redactions:
            action, text = PolicyAction.REDACT, redact(text, disjoint(redactions))
        return Verdict(action, tuple(matched), text, self.version)


def _compile(spec: RuleSpec) -> tuple[Any, ...]:
    patterns = []
    for pattern in spec.regex:
        try:
            patterns.append(re2.compile(pattern))
        except re2.error as err:
            raise RuleSetError(f"rule {spec.id}: regex {pattern!r}: {err}") from None
    if spec.keywords:
        # Whitespace inside a phrase matches any run of whitespace; \b keeps words whole.
        phrases = (r"\s+".join(re.escape(w) for w in k.split()) for k in spec.keywords)
        patterns.append(re2.compile(r"(?i)\b(?:" + "|".join(phrases) + r")\b"))
    return tuple(patterns)

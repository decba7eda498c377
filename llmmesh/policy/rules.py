"""Rule sets: loading and validating YAML, and matching text against them."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from llmmesh.policy.detectors import DETECTORS, disjoint, redact
from llmmesh.policy.encoded import encoded_hits
from llmmesh.policy.matching import (
    Hit,
    Matcher,
    PatternError,
    RuleMatchers,
    Views,
    compile_regex,
)
from llmmesh.types import PolicyAction, Verdict


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
    # Matchers (at least one kind): keywords, case-insensitive, any whitespace run
    # matching a space, whole words unless whole_word is false; RE2 regular expressions;
    # built-in detectors (llmmesh/policy/detectors.py).
    keywords: list[str] = Field(default_factory=list)
    whole_word: bool = True
    regex: list[str] = Field(default_factory=list)
    detectors: list[str] = Field(default_factory=list)
    placeholder: str = "[REDACTED]"  # for keyword and regex matches of a redact rule
    # Match on the normalized views of the text (llmmesh/policy/normalize.py: Unicode
    # compatibility forms, invisible characters, combining marks, look-alike letters,
    # separators between a keyword's letters); false: on the text as it is.
    normalize: bool = True

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

    def applies_to(self, stage: Stage) -> bool:
        return self.stage in (stage, Stage.BOTH)


class RuleSetSpec(BaseModel):
    """One rule set document. A set may start from another (``extends``): its rules
    replace the inherited ones of the same id, ``disable`` drops inherited ones, and new
    ones follow the inherited."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    version: str = Field(min_length=1)
    extends: str | None = None
    disable: list[str] = Field(default_factory=list)
    rules: list[RuleSpec]
    # The streamed output check holds no text back for more than this many generated
    # tokens: text that could still grow into a match goes out as it is once it has
    # waited that long (a match it was the start of is then not redacted, nor denied).
    # Unset: held until settled (at most the policy service's output_holdback_cap
    # characters). A derived set inherits its base's unless it sets its own.
    output_holdback_tokens: int | None = Field(default=None, ge=1, le=65536)

    @model_validator(mode="after")
    def _unique_ids(self) -> RuleSetSpec:
        ids = [r.id for r in self.rules]
        duplicates = sorted({i for i in ids if ids.count(i) > 1})
        if duplicates:
            raise ValueError(f"duplicate rule ids: {duplicates}")
        return self


class RuleSetError(ValueError):
    """A rule set is invalid; the message says where."""


def read_rule_file(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise RuleSetError(f"cannot read rule file {path}: {exc}") from None


def parse_rule_set(text: str, source: str) -> RuleSetSpec:
    try:
        doc: Any = yaml.safe_load(text)
        return RuleSetSpec.model_validate(doc)
    except yaml.YAMLError as exc:
        raise RuleSetError(f"cannot read rule set {source}: {exc}") from None
    except ValidationError as exc:
        raise RuleSetError(f"invalid rule set {source}: {exc}") from None


DEFAULT_HOLDBACK_CAP = 256


@dataclass(frozen=True)
class Decision:
    """What the rules of one stage found in a text: matched rule ids in rule-set order,
    the deny rule that matched first (if any), and the text with redactions applied."""

    rule_ids: tuple[str, ...]
    denied_by: str | None
    text: str
    redacted: bool

    def verdict(self, version: str) -> Verdict:
        action = action_of(self.denied_by, self.redacted)
        return Verdict(action, self.rule_ids, (self.text,), version)


def action_of(denied_by: str | None, redacted: bool) -> PolicyAction:
    if denied_by is not None:
        return PolicyAction.DENY
    return PolicyAction.REDACT if redacted else PolicyAction.ALLOW


class StageRules:
    """The rules of a set that apply at one stage, compiled into one matcher."""

    def __init__(
        self, rules: Sequence[RuleSpec], holdback_cap: int, holdback_tokens: int | None = None
    ) -> None:
        self.rules = list(rules)
        self.holdback_tokens = holdback_tokens  # the streamed check's bound, in tokens
        matchers = [_matchers(r) for r in self.rules]
        try:
            self.matcher = Matcher(matchers, holdback_cap, [r.normalize for r in self.rules])
        except PatternError as err:
            raise RuleSetError(str(err)) from None

    def __bool__(self) -> bool:
        return bool(self.rules)

    def denies(self, rule: int) -> bool:
        return self.rules[rule].action is RuleAction.DENY

    def decide(self, text: str, hits: Sequence[Hit], offset: int = 0) -> Decision:
        """Applies ``hits`` (positions ``offset`` past the start of ``text``)."""
        matched = sorted({h.rule for h in hits if h.valid})
        deny = [i for i in matched if self.denies(i)]
        redactions = [
            (h.start - offset, h.end - offset, h.placeholder or self.rules[h.rule].placeholder)
            for h in hits
            if h.valid and self.rules[h.rule].action is RuleAction.REDACT
        ]
        redacted = redact(text, disjoint(redactions)) if redactions and not deny else text
        return Decision(
            tuple(self.rules[i].id for i in matched),
            self.rules[deny[0]].id if deny else None,
            redacted,
            bool(redactions) and not deny,
        )

    def check(self, text: str) -> Decision:
        return self.decide(text, self.matcher.hits(text))

    def input_hits(self, text: str) -> list[Hit]:
        """Every match in what a model reads of a prompt ``text``: its own, and those in
        what its base64 and hexadecimal runs decode to (llmmesh/policy/encoded.py)."""
        views = Views(text)
        return self.matcher.hits(views) + encoded_hits(self.matcher, views)


def _matchers(spec: RuleSpec) -> RuleMatchers:
    try:
        compiled = [compile_regex(p) for p in spec.regex]
    except PatternError as err:
        raise RuleSetError(f"rule {spec.id}: {err}") from None
    return RuleMatchers(spec.keywords, spec.whole_word, compiled, spec.detectors, spec.placeholder)


class RuleSet:
    """A resolved rule set (inheritance applied), compiled per stage."""

    def __init__(
        self,
        rules: Sequence[RuleSpec],
        version: str,
        holdback_cap: int = DEFAULT_HOLDBACK_CAP,
        holdback_tokens: int | None = None,
    ) -> None:
        self.version = version
        self.specs = tuple(rules)
        self.holdback_tokens = holdback_tokens
        self.input = StageRules([r for r in rules if r.applies_to(Stage.INPUT)], holdback_cap)
        output = [r for r in rules if r.applies_to(Stage.OUTPUT)]
        self.output = StageRules(output, holdback_cap, holdback_tokens)

    @classmethod
    def from_spec(cls, spec: RuleSetSpec, holdback_cap: int = DEFAULT_HOLDBACK_CAP) -> RuleSet:
        if spec.extends:
            raise RuleSetError(f"set extends '{spec.extends}': load it through a RuleLibrary")
        return cls(spec.rules, spec.version, holdback_cap, spec.output_holdback_tokens)

    @classmethod
    def from_text(cls, text: str, source: str) -> RuleSet:
        return cls.from_spec(parse_rule_set(text, source))

    @classmethod
    def from_file(cls, path: Path) -> RuleSet:
        return cls.from_text(read_rule_file(path), str(path))

    def check_input(self, text: str) -> Verdict:
        """Deny wins; otherwise redact rules replace what they match; flags only report."""
        return self.input.decide(text, self.input.input_hits(text)).verdict(self.version)

    def check_output(self, text: str) -> Verdict:
        """The whole of a generated text at once (the streamed check gives the same)."""
        return self.output.check(text).verdict(self.version)

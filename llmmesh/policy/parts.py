"""Checking everything a model will read at once: the parts of a prompt (each message of
a conversation, each turn of a session's history, its system prompt and summary, the new
message) are checked as one text, so that a phrase split across two of them is caught,
and each match is reported, and redacted, in the part where it lies.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from llmmesh.policy.detectors import disjoint, redact
from llmmesh.policy.joined import SEPARATOR, Joined
from llmmesh.policy.rules import RuleAction, RuleSet, StageRules, action_of
from llmmesh.types import Verdict

PART_SEPARATOR = SEPARATOR  # between parts in the joined text


@dataclass(frozen=True)
class Part:
    """One piece of what the model will read, and where it came from (a request field
    such as ``messages[2].content``, or ``session.turns[4]``)."""

    field: str
    text: str


@dataclass(frozen=True)
class PartsDecision:
    """What the input rules found in a prompt's parts: matched rule ids in rule-set order,
    the deny rule that matched first (if any) and the part where its match starts, each
    part's text with redactions applied, and where each rule matched."""

    rule_ids: tuple[str, ...]
    denied_by: str | None
    denied_at: str
    texts: tuple[str, ...]
    redacted: bool
    matched_in: tuple[tuple[str, str], ...]  # (rule id, field) of each match, in order

    def verdict(self, rules: RuleSet) -> Verdict:
        return Verdict(
            action_of(self.denied_by, self.redacted),
            (self.denied_by, *(r for r in self.rule_ids if r != self.denied_by))
            if self.denied_by
            else self.rule_ids,
            self.texts,
            rules.version,
            checks_output=bool(rules.output),
            denied_at=self.denied_at,
            matches=self.matched_in,
        )


def check_parts(rules: StageRules, parts: Sequence[Part]) -> PartsDecision:
    """The input rules applied to ``parts`` as one text."""
    texts = tuple(p.text for p in parts)
    if not rules or not parts:
        return PartsDecision((), None, "", texts, False, ())
    layout = Joined(texts)
    hits = sorted((h for h in rules.input_hits(layout.text) if h.valid), key=lambda h: h.start)
    matched = sorted({h.rule for h in hits})
    matched_in = tuple(
        dict.fromkeys((rules.rules[h.rule].id, parts[layout.index_at(h.start)].field) for h in hits)
    )
    rule_ids = tuple(rules.rules[i].id for i in matched)
    deny = [i for i in matched if rules.denies(i)]
    if deny:
        first = next(h for h in hits if h.rule == deny[0])
        at = parts[layout.index_at(first.start)].field
        return PartsDecision(rule_ids, rules.rules[deny[0]].id, at, texts, False, matched_in)
    spans = disjoint(
        [
            (h.start, h.end, h.placeholder or rules.rules[h.rule].placeholder)
            for h in hits
            if rules.rules[h.rule].action is RuleAction.REDACT
        ]
    )
    if not spans:
        return PartsDecision(rule_ids, None, "", texts, False, matched_in)
    return PartsDecision(rule_ids, None, "", _redacted(texts, layout, spans), True, matched_in)


def _redacted(
    texts: tuple[str, ...], layout: Joined, spans: list[tuple[int, int, str]]
) -> tuple[str, ...]:
    """Each part with the spans (joined-text positions) that fall in it replaced; a span
    across parts leaves its placeholder in the part where it starts and removes the rest."""
    per_part: list[list[tuple[int, int, str]]] = [[] for _ in texts]
    for start, end, placeholder in spans:
        first, last = layout.index_at(start), layout.index_at(end - 1)
        for index in range(first, last + 1):
            offset = layout.starts[index]
            lo = max(start - offset, 0)
            hi = min(end - offset, len(texts[index]))
            per_part[index].append((lo, hi, placeholder if index == first else ""))
    return tuple(redact(t, s) if s else t for t, s in zip(texts, per_part, strict=True))


def check_input(rules: RuleSet, parts: Sequence[Part]) -> PartsDecision:
    """A rule set's input rules on ``parts``: deny wins; otherwise redact rules replace
    what they match; flags only report."""
    return check_parts(rules.input, parts)

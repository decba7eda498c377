"""Policy core: applies a tenant's rule set to prompts and to generated text as it
streams, counts decisions and writes the audit trail."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from prometheus_client import Counter, Histogram

from llmmesh.policy import (
    PART_SEPARATOR,
    OutputDecision,
    OutputStep,
    Part,
    RuleLibrary,
    StageRules,
    StreamCheck,
)
from llmmesh.policy.off_loop import input_verdict_off_loop
from llmmesh.runtime.errors import InvalidArgument
from llmmesh.types import PolicyAction, Verdict
from services.policy.audit import AuditLog

log = logging.getLogger(__name__)

DECISIONS = Counter("llm_policy_decisions_total", "Policy decisions", ["stage", "action"])
RULE_MATCHES = Counter("llm_policy_rule_matches_total", "Rule matches", ["rule_id", "stage"])
CHECK_SECONDS = Histogram(
    "llm_policy_check_seconds",
    "Time to check one prompt or one output chunk",
    ["stage"],
    buckets=(0.00001, 0.00002, 0.00005, 0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01),
)
HELD_CHARS = Histogram(
    "llm_policy_output_held_chars",
    "Characters of generated text held back after each chunk",
    buckets=(0, 4, 8, 16, 32, 64, 128, 256, 512),
)
MAX_TEXT_CHARS = 1_000_000


def check_text(field: str, text: str) -> None:
    if len(text) > MAX_TEXT_CHARS:
        raise InvalidArgument(field, f"longer than {MAX_TEXT_CHARS} characters")


def check_parts_size(parts: Sequence[Part]) -> None:
    if sum(len(p.text) for p in parts) > MAX_TEXT_CHARS:
        raise InvalidArgument("parts", f"longer than {MAX_TEXT_CHARS} characters in all")


class PolicyCore:
    def __init__(self, library: RuleLibrary, audit: AuditLog | None = None) -> None:
        self.library = library
        self._audit = audit

    async def check_input(
        self, tenant: str, parts: Sequence[Part], request_id: str = "", rule_set: str = ""
    ) -> Verdict:
        """Everything a model will read, checked as one text (llmmesh/policy/parts.py),
        a long text beside the event loop (llmmesh/policy/off_loop.py)."""
        check_parts_size(parts)
        rules = self.library.get(rule_set)
        started = time.perf_counter()
        verdict = await input_verdict_off_loop(rules, parts, tenant)
        CHECK_SECONDS.labels("input").observe(time.perf_counter() - started)
        self.record_decision(
            stage="input",
            request_id=request_id,
            tenant=tenant,
            action=verdict.action,
            rule_ids=verdict.rule_ids,
            text=PART_SEPARATOR.join(p.text for p in parts),
            version=verdict.rule_set_version,
        )
        return verdict

    @property
    def audits_text(self) -> bool:
        return self._audit is not None and self._audit.include_text

    def has_output_rules(self, rule_set: str) -> bool:
        return bool(self.library.get(rule_set).output)

    def open_output(
        self, tenant: str, request_id: str, rule_set: str, lead: str = ""
    ) -> OutputCheck:
        """A streamed check of one generation, with the set in force now to its end;
        ``lead``: text the output continues (StreamCheck's)."""
        rules = self.library.get(rule_set)
        return OutputCheck(self, rules.output, tenant, request_id, rules.version, lead=lead)

    def record_decision(
        self,
        *,
        stage: str,
        request_id: str,
        tenant: str,
        action: PolicyAction,
        rule_ids: Sequence[str],
        text: str,
        version: str,
    ) -> None:
        DECISIONS.labels(stage, action.value).inc()
        for rule_id in rule_ids:
            RULE_MATCHES.labels(rule_id, stage).inc()
        if self._audit is not None:
            self._audit.record(
                request_id=request_id,
                tenant=tenant,
                stage=stage,
                action=action.value,
                rule_ids=tuple(rule_ids),
                rule_set_version=version,
                text=text,
            )
        if rule_ids:
            log.info(
                "policy match",
                extra={
                    "fields": {
                        "stage": stage,
                        "tenant": tenant,
                        "rule_ids": list(rule_ids),
                        "action": action.value,
                        "rule_set_version": version,
                    }
                },
            )


class OutputCheck:
    """One generation's streamed check, timed; ``close`` records the decision once."""

    def __init__(
        self,
        core: PolicyCore,
        rules: StageRules,
        tenant: str,
        request_id: str,
        version: str,
        *,
        lead: str = "",
    ) -> None:
        self.version = version

        def record(decision: OutputDecision) -> None:
            core.record_decision(
                stage="output",
                request_id=request_id,
                tenant=tenant,
                action=decision.action,
                rule_ids=decision.rule_ids,
                text=decision.text,
                version=version,
            )

        self._check = StreamCheck(rules, record, keep_text=core.audits_text, lead=lead)

    def feed(self, text: str, final: bool = False, tokens: int = 1) -> OutputStep:
        check_text("text", text)
        started = time.perf_counter()
        step = self._check.feed(text, final, tokens)
        CHECK_SECONDS.labels("output_chunk").observe(time.perf_counter() - started)
        HELD_CHARS.observe(step.held)
        return step

    def close(self) -> None:
        """Records the stream's decision (also when the stream was cut short)."""
        self._check.close()

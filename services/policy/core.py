"""Policy core: applies the active rule set to prompts and counts decisions."""

from __future__ import annotations

import logging
import time

from prometheus_client import Counter, Histogram

from llmmesh.runtime.errors import InvalidArgument
from llmmesh.types import Verdict
from services.policy.audit import AuditLog
from services.policy.rules import RuleSet, RuleSetError

log = logging.getLogger(__name__)

DECISIONS = Counter("llm_policy_decisions_total", "Policy decisions", ["stage", "action"])
RULE_MATCHES = Counter("llm_policy_rule_matches_total", "Rule matches", ["rule_id"])
CHECK_SECONDS = Histogram(
    "llm_policy_check_seconds",
    "Time to check one text",
    ["stage"],
    buckets=(0.00005, 0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01),
)

RULES_REJECTED = Counter("llm_policy_rules_rejected_total", "Rule files refused as invalid")
MAX_TEXT_CHARS = 1_000_000


class PolicyCore:
    def __init__(self, rules: RuleSet, audit: AuditLog | None = None) -> None:
        self.rules = rules
        self._audit = audit

    def offer(self, text: str, source: str) -> bool:
        """Swaps in a changed rule set if it is valid; otherwise the current one stays."""
        try:
            rules = RuleSet.from_text(text, source)
        except RuleSetError as err:
            RULES_REJECTED.inc()
            log.warning(
                "rule set rejected; the previous one stays",
                extra={"fields": {"reason": str(err), "version": self.rules.version}},
            )
            return False
        if rules.version != self.rules.version:
            log.info("rule set applied", extra={"fields": {"version": rules.version}})
        self.rules = rules  # one reference swap: a check sees the old set or the new one
        return True

    def check_input(self, tenant: str, text: str, request_id: str = "") -> Verdict:
        if len(text) > MAX_TEXT_CHARS:
            raise InvalidArgument("text", f"longer than {MAX_TEXT_CHARS} characters")
        started = time.perf_counter()
        verdict = self.rules.check_input(text)
        CHECK_SECONDS.labels("input").observe(time.perf_counter() - started)
        DECISIONS.labels("input", verdict.action.value).inc()
        for rule_id in verdict.rule_ids:
            RULE_MATCHES.labels(rule_id).inc()
        if self._audit is not None:
            self._audit.record(
                request_id=request_id,
                tenant=tenant,
                stage="input",
                action=verdict.action.value,
                rule_ids=verdict.rule_ids,
                rule_set_version=verdict.rule_set_version,
                text=text,
            )
        if verdict.rule_ids:
            log.info(
                "policy match",
                extra={
                    "fields": {
                        "tenant": tenant,
                        "rule_ids": verdict.rule_ids,
                        "action": verdict.action.value,
                        "rule_set_version": verdict.rule_set_version,
                    }
                },
            )
        return verdict

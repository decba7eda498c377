"""Rule sets as they travel from the policy service to the router: the rule documents as
JSON, with the schema version they follow.

The two deploy independently. A router older than its policy service may be handed a
rule with a field it does not know: the rule loads without that field, with a log line
naming it, rather than failing the requests that need the rules. Whatever a router knows
it applies exactly.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from pydantic import ValidationError

from llmmesh.policy.rules import RuleSet, RuleSetError, RuleSpec

log = logging.getLogger(__name__)

# 1: the fields of RuleSpec as of this release (stage, action, keywords, whole_word,
# regex, detectors, placeholder, normalize).
SCHEMA_VERSION = 1


def dump_rules(rules: RuleSet) -> str:
    return json.dumps([rule.model_dump(mode="json") for rule in rules.specs])


def load_rules(
    text: str,
    version: str,
    holdback_cap: int,
    schema_version: int,
    holdback_tokens: int | None = None,
) -> RuleSet:
    """The rule set in ``text`` (dump_rules); RuleSetError when it cannot be loaded."""
    try:
        documents = json.loads(text)
        if not isinstance(documents, list):
            raise RuleSetError("rules must be a JSON list")
        rules = [_rule(d, schema_version) for d in documents]
        return RuleSet(rules, version, holdback_cap, holdback_tokens)
    except (ValueError, TypeError, ValidationError) as err:  # JSON and validation errors
        raise RuleSetError(f"rules do not load: {err}") from None


def _rule(document: Any, schema_version: int) -> RuleSpec:
    if not isinstance(document, dict):
        raise RuleSetError("each rule must be a JSON object")
    unknown = sorted(set(document) - set(RuleSpec.model_fields))
    if unknown:
        log.warning(
            "rule fields this version does not know are ignored",
            extra={
                "fields": {
                    "rule": document.get("id"),
                    "fields": unknown,
                    "schema_version": schema_version,
                    "known_schema_version": SCHEMA_VERSION,
                }
            },
        )
    return RuleSpec.model_validate({k: v for k, v in document.items() if k not in unknown})

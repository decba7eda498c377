"""`llm-mesh bench --start-stack --rules input`: the stack's demo tenant on the default
set's rules on input only."""

from __future__ import annotations

import json
from pathlib import Path

from bench.policy import input_rules_tenant
from llmmesh.launcher.stack import DEMO_KEY_FILE
from llmmesh.policy.rules import RuleSet
from services.router.tenants import hash_key


def test_the_demo_tenant_checks_input_only_with_the_default_sets_rules(tmp_path: Path) -> None:
    env = input_rules_tenant(tmp_path)
    rules = Path(env["LLM_MESH_POLICY_RULES_PATH"])
    default = RuleSet.from_file(rules / "default.yaml")
    input_only = RuleSet.from_file(rules / "default-input.yaml")
    assert default.output and not input_only.output  # no streamed output check
    every_rule = {r.id for stage in (default.input, default.output) for r in stage.rules}
    assert {r.id for r in input_only.input.rules} == every_rule
    key = (tmp_path / DEMO_KEY_FILE).read_text().strip()
    (tenant,) = json.loads((tmp_path / "tenants.yaml").read_text())["tenants"]
    assert tenant["policy_set"] == "default-input"
    assert tenant["api_key_hashes"] == [hash_key(key)]

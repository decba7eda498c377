"""A policy service swaps its rule set when the file changes, and keeps it when the new
file is invalid."""

from __future__ import annotations

from pathlib import Path

from llmmesh.client import internal_channel
from llmmesh.launcher import Stack, StackPorts
from llmmesh.v1 import policy_pb2, policy_pb2_grpc
from tests.conftest import start_service, wait_for

RULES = """\
version: "{version}"
rules:
  - id: deny-{word}
    action: deny
    keywords: [{word}]
"""


def test_rules_reload_on_change_and_an_invalid_file_is_refused(
    stack: Stack, tmp_path: Path
) -> None:
    rules = tmp_path / "rules.yaml"
    rules.write_text(RULES.format(version="v1", word="apples"))
    port = StackPorts.free().policy
    policy = start_service(
        stack, "policy", port, tmp_path, rules_path=str(rules), watch_interval_s="0.05"
    )
    try:
        with internal_channel(f"127.0.0.1:{port}", stack.internal_token) as channel:
            stub = policy_pb2_grpc.PolicyStub(channel)

            def check(text: str) -> policy_pb2.CheckInputResponse:
                request = policy_pb2.CheckInputRequest(request_id="r", tenant="t", text=text)
                reply: policy_pb2.CheckInputResponse = stub.CheckInput(request, timeout=5)
                return reply

            assert check("apples").action == policy_pb2.ACTION_DENY
            rules.write_text(RULES.format(version="v2", word="pears"))
            wait_for(lambda: check("pears").rule_set_version == "v2", 10, "the new rules")
            assert check("pears").action == policy_pb2.ACTION_DENY
            assert check("apples").action == policy_pb2.ACTION_ALLOW
            rules.write_text("version: v3\nrules: [{id: x, action: deny}]\n")  # no matcher
            wait_for(
                lambda: "rejected" in (tmp_path / f"policy-{port}.log").read_text(),
                10,
                "the invalid file's rejection",
            )
            still = check("pears")
            assert (still.action, still.rule_set_version) == (policy_pb2.ACTION_DENY, "v2")
    finally:
        policy.terminate(5)

"""Per-tenant rule sets and the streamed output check through the real stack: an output
rule stops a generation mid-stream, and rule sets reload while streams run."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from llmmesh.client import authorized_channel, build_request, internal_channel
from llmmesh.launcher import Stack, StackPorts
from llmmesh.v1 import (
    common_pb2,
    generation_pb2,
    generation_pb2_grpc,
    policy_pb2,
    policy_pb2_grpc,
)
from services.policy.config import DEFAULT_RULES
from tests.conftest import collect, metric_value, start_service, text_of, wait_for
from tests.e2e.test_tenants import write_tenants

# What sidecars change (mTLS, RBAC, original-destination routing, each service's calls
# through its sidecar): run again behind them (make test-sidecars).
pytestmark = pytest.mark.sidecars

PROMPT = "Tell me a story about the sea."
TOKENS = 48
LONG_ANSWER = 192


def strict_rules(version: str, phrase: str) -> str:
    return json.dumps(
        {
            "version": version,
            "extends": "default",
            "rules": [
                {
                    "id": "no-phrase",
                    "stage": "output",
                    "action": "deny",
                    "keywords": [phrase],
                    "whole_word": False,
                }
            ],
        }
    )


@dataclass
class PolicyMesh:
    router: str
    policy: str
    token: str
    policy_metrics: str
    rules: Path
    keys: dict[str, str]

    def generate(
        self, tenant: str, max_tokens: int = TOKENS
    ) -> list[generation_pb2.GenerateResponse]:
        with authorized_channel(self.router, self.keys[tenant]) as channel:
            return collect(channel, PROMPT, max_tokens=max_tokens, seed=7, ignore_eos=True)

    def version(self, rule_set: str) -> str:
        with internal_channel(self.policy, self.token) as channel:
            stub = policy_pb2_grpc.PolicyStub(channel)
            request = policy_pb2.CheckInputRequest(text="x", rule_set=rule_set)
            reply: policy_pb2.CheckInputResponse = stub.CheckInput(request, timeout=5)
            return reply.rule_set_version


@pytest.fixture(scope="module")
def mesh(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PolicyMesh]:
    """A policy service with a rules directory (default + strict) and a router whose
    tenant "strict" uses the strict set."""
    tmp = tmp_path_factory.mktemp("policy-output")
    rules = tmp / "rules"
    rules.mkdir()
    (rules / "default.yaml").write_text(DEFAULT_RULES.read_text())
    (rules / "strict.yaml").write_text(strict_rules("s0", "no such phrase anywhere"))
    keys = write_tenants(
        tmp / "tenants.json",
        {"plain": {"id": "plain"}, "strict": {"id": "strict", "policy_set": "strict"}},
    )
    ports = StackPorts.free()
    policy = start_service(
        stack,
        "policy",
        ports.policy,
        tmp,
        rules_path=str(rules),
        watch_interval_s="0.05",
        metrics_port=str(ports.policy_metrics),
    )
    router = start_service(
        stack,
        "router",
        ports.router,
        tmp,
        tenants_file=str(tmp / "tenants.json"),
        policy_address=f"127.0.0.1:{ports.policy}",
    )
    try:
        yield PolicyMesh(
            f"127.0.0.1:{ports.router}",
            f"127.0.0.1:{ports.policy}",
            stack.internal_token,
            f"http://127.0.0.1:{ports.policy_metrics}/metrics",
            rules,
            keys,
        )
    finally:
        router.terminate(5)
        policy.terminate(5)


def test_an_output_rule_stops_the_generation_mid_stream(mesh: PolicyMesh) -> None:
    # Long, with the phrase a quarter in: past a stream's first responses the engine sends
    # several tokens a response, and the cancel takes a response or two to reach it, so a
    # short answer can end before its stop does.
    full = text_of(mesh.generate("plain", max_tokens=LONG_ANSWER))
    quarter = len(full) // 4
    phrase = full[quarter : quarter + 4].strip() or full.strip()[:4]
    mesh.rules.joinpath("strict.yaml").write_text(strict_rules("s1", phrase))
    wait_for(lambda: mesh.version("strict").startswith("s1+"), 10, "the strict set")

    responses = mesh.generate("strict", max_tokens=LONG_ANSWER)
    stopped = text_of(responses)
    last = responses[-1]
    assert last.finish_reason == common_pb2.FINISH_REASON_POLICY
    assert phrase.lower() not in stopped.lower()
    assert full.startswith(stopped)  # nothing but the held-back tail was lost
    assert last.usage.completion_tokens < LONG_ANSWER
    # The router reports the decision to policy once the stream has ended.
    labels = {"stage": "output", "action": "deny"}
    wait_for(
        lambda: metric_value(mesh.policy_metrics, "llm_policy_decisions_total", labels) >= 1,
        10,
        "policy to record the output decision",
    )
    # The plain tenant's default set has no such rule: its stream is whole.
    assert text_of(mesh.generate("plain", max_tokens=LONG_ANSWER)) == full


def test_rules_reload_while_streams_run(mesh: PolicyMesh) -> None:
    full = text_of(mesh.generate("plain", 96))
    mesh.rules.joinpath("strict.yaml").write_text(strict_rules("r1", "no such phrase"))
    wait_for(lambda: mesh.version("strict").startswith("r1+"), 10, "set r1")
    with authorized_channel(mesh.router, mesh.keys["strict"]) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        call = stub.Generate(build_request(PROMPT, max_tokens=96, seed=7, ignore_eos=True))
        first = next(call)
        # A rule that would stop this stream arrives while it runs: a stream keeps the set
        # it started with, so it ends whole.
        phrase = full[60:64].strip() or full.strip()[-4:]
        mesh.rules.joinpath("strict.yaml").write_text(strict_rules("r2", phrase))
        wait_for(lambda: mesh.version("strict").startswith("r2+"), 10, "set r2")
        rest = list(call)
    running = [first, *rest]
    assert text_of(running) == full
    assert running[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    # A new stream checks with the new set.
    after = mesh.generate("strict", 96)
    assert after[-1].finish_reason == common_pb2.FINISH_REASON_POLICY


def test_a_phrase_the_prompt_begins_and_the_model_ends_is_stopped(mesh: PolicyMesh) -> None:
    """A plain completion's prompt is text the model's words continue: a deny phrase of
    the prompt's last characters and the answer's first stops the stream before any of
    it goes out, though the answer alone never has the phrase."""
    full = text_of(mesh.generate("plain"))
    phrase = PROMPT[-3:] + full[:3]
    assert phrase not in full and phrase not in PROMPT
    mesh.rules.joinpath("strict.yaml").write_text(strict_rules("j1", phrase))
    wait_for(lambda: mesh.version("strict").startswith("j1+"), 10, "set j1")
    responses = mesh.generate("strict")
    assert responses[-1].finish_reason == common_pb2.FINISH_REASON_POLICY
    assert text_of(responses) == ""

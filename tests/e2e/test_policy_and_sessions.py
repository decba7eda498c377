"""Policy denial and session history, through the router, against the real services."""

from __future__ import annotations

import json
import uuid

import grpc
import pytest

from llmmesh.client import authorized_channel, build_request, internal_channel
from llmmesh.launcher import Stack
from llmmesh.v1 import context_pb2, context_pb2_grpc, generation_pb2_grpc
from tests.conftest import collect, text_of, wait_for

# What sidecars change (mTLS, RBAC, original-destination routing, each service's calls
# through its sidecar): run again behind them (make test-sidecars).
pytestmark = pytest.mark.sidecars

DEMO_TENANT = "demo"  # the tenant of the local stack's API key


def test_denied_prompt_is_permission_denied_with_the_rule_id(router_channel: grpc.Channel) -> None:
    with pytest.raises(grpc.RpcError) as info:
        collect(router_channel, "explain how to build a bomb", max_tokens=4)
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "deny-weapons" in (info.value.details() or "")


def test_pii_is_redacted_before_the_model_and_the_session_see_it(stack: Stack) -> None:
    session = f"pii-{uuid.uuid4().hex[:8]}"
    prompt = "Reach me at ada@example.com or +44 20 7946 0958."
    with authorized_channel(stack.address("router"), stack.api_key) as channel:
        responses = collect(channel, prompt, max_tokens=4, ignore_eos=True, session_id=session)
    assert responses[-1].usage.completion_tokens == 4
    with internal_channel(stack.address("context"), stack.internal_token) as channel:
        stored = context_pb2_grpc.ContextStub(channel).LoadSession(
            context_pb2.LoadSessionRequest(tenant=DEMO_TENANT, session_id=session), timeout=5
        )
    assert stored.turns[0].text == "Reach me at [EMAIL] or [PHONE]."


def test_every_decision_is_audited_without_the_prompt(stack: Stack) -> None:
    request_id = f"audit-{uuid.uuid4().hex[:8]}"
    prompt = "explain how to build a bomb"
    with (
        authorized_channel(stack.address("router"), stack.api_key) as channel,
        pytest.raises(grpc.RpcError),
    ):
        list(
            generation_pb2_grpc.GenerationStub(channel).Generate(
                build_request(prompt, max_tokens=2), metadata=(("x-request-id", request_id),)
            )
        )
    line = wait_for_audit(stack, request_id, "input")
    assert (line["tenant"], line["action"], line["rule_ids"]) == ("demo", "deny", ["deny-weapons"])
    assert prompt not in (stack.workdir / "logs" / "audit.log").read_text()


def test_the_routers_output_check_is_audited_by_policy(stack: Stack) -> None:
    """The router checks generated text itself, with policy's rules, and reports each
    generation's decision back to policy's audit trail."""
    request_id = f"audit-{uuid.uuid4().hex[:8]}"
    with authorized_channel(stack.address("router"), stack.api_key) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        request = build_request("Say hello", max_tokens=8, ignore_eos=True)
        list(stub.Generate(request, metadata=(("x-request-id", request_id),), timeout=30))
    line = wait_for_audit(stack, request_id, "output")
    assert (line["tenant"], line["action"]) == ("demo", "allow")
    assert line["rule_set_version"]


def wait_for_audit(stack: Stack, request_id: str, stage: str) -> dict[str, object]:
    """The audit line of one request's decision at ``stage``, once policy wrote it."""
    audit = stack.workdir / "logs" / "audit.log"

    def entry() -> dict[str, object] | None:
        for line in audit.read_text().splitlines() if audit.exists() else ():
            if request_id in line:
                found: dict[str, object] = json.loads(line)
                if found["stage"] == stage:
                    return found
        return None

    wait_for(lambda: entry() is not None, 10, f"the {stage} decision's audit line")
    line = entry()
    assert line is not None
    return line


def test_session_history_is_persisted_and_prepended(stack: Stack) -> None:
    session = f"s-{uuid.uuid4().hex[:8]}"
    with authorized_channel(stack.address("router"), stack.api_key) as channel:
        first = collect(channel, "My name is Ada.", max_tokens=10, session_id=session)
        second = collect(channel, "What is my name?", max_tokens=10, session_id=session)
    answer = text_of(first)

    with internal_channel(stack.address("context"), stack.internal_token) as channel:
        stored = context_pb2_grpc.ContextStub(channel).LoadSession(
            context_pb2.LoadSessionRequest(tenant=DEMO_TENANT, session_id=session), timeout=5
        )
    assert [(t.role, t.text) for t in stored.turns] == [
        (context_pb2.ROLE_USER, "My name is Ada."),
        (context_pb2.ROLE_ASSISTANT, answer),
        (context_pb2.ROLE_USER, "What is my name?"),
        (context_pb2.ROLE_ASSISTANT, text_of(second)),
    ]
    # The second prompt carried the first exchange: history tokens were added to it.
    assert second[-1].usage.prompt_tokens > first[-1].usage.prompt_tokens + len(answer)


def test_session_id_from_metadata(stack: Stack) -> None:
    from llmmesh.v1 import generation_pb2_grpc

    session = f"m-{uuid.uuid4().hex[:8]}"
    with authorized_channel(stack.address("router"), stack.api_key) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        list(
            stub.Generate(
                build_request("hello", max_tokens=3),
                metadata=(("x-session-id", session),),
                timeout=30,
            )
        )
    with internal_channel(stack.address("context"), stack.internal_token) as channel:
        stored = context_pb2_grpc.ContextStub(channel).LoadSession(
            context_pb2.LoadSessionRequest(tenant=DEMO_TENANT, session_id=session), timeout=5
        )
    assert len(stored.turns) == 2


def test_request_without_session_records_nothing(stack: Stack) -> None:
    with (
        internal_channel(stack.address("context"), stack.internal_token) as channel,
        pytest.raises(grpc.RpcError) as info,
    ):
        context_pb2_grpc.ContextStub(channel).LoadSession(
            context_pb2.LoadSessionRequest(tenant=DEMO_TENANT, session_id="never-used"), timeout=5
        )
    assert info.value.code() == grpc.StatusCode.NOT_FOUND

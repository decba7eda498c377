"""The internal services answer bad input with INVALID_ARGUMENT naming the field, and live on."""

from __future__ import annotations

import json
from collections.abc import Callable

import grpc
import pytest

from llmmesh.client import internal_channel
from llmmesh.launcher import Stack
from llmmesh.policy.rules import RuleSpec
from llmmesh.v1 import (
    common_pb2,
    context_pb2,
    context_pb2_grpc,
    inference_pb2,
    inference_pb2_grpc,
    policy_pb2,
    policy_pb2_grpc,
)
from tests.conftest import bad_request_fields


def _raw_call(stack: Stack, service: str, path: str, payload: bytes) -> grpc.RpcError:
    with internal_channel(stack.address(service), stack.internal_token) as channel:
        call = channel.unary_unary(
            path, request_serializer=lambda b: b, response_deserializer=lambda b: b
        )
        with pytest.raises(grpc.RpcError) as info:
            call(payload, timeout=10)
    return info.value


def test_policy_rejects_invalid_utf8(stack: Stack) -> None:
    err = _raw_call(stack, "policy", "/llmmesh.v1.Policy/CheckInput", b"\x1a\x02\xff\xfe")
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert bad_request_fields(err) == ["text"]


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        (context_pb2.AppendTurnsRequest(tenant="t", session_id="s", request_id="r"), "turns"),
        (
            context_pb2.AppendTurnsRequest(
                tenant="t", session_id="s", request_id="r", turns=[context_pb2.Turn(text="x")]
            ),
            "turns[0].role",
        ),
        (
            context_pb2.AppendTurnsRequest(
                tenant="t",
                session_id="s",
                turns=[context_pb2.Turn(role=context_pb2.ROLE_USER, text="x")],
            ),
            "request_id",
        ),
        (context_pb2.AppendTurnsRequest(tenant="", session_id="s", request_id="r"), "tenant"),
        (
            context_pb2.AppendTurnsRequest(tenant="t", session_id="a b", request_id="r"),
            "session_id",
        ),
    ],
)
def test_context_rejects_bad_appends(
    stack: Stack, request_: context_pb2.AppendTurnsRequest, field: str
) -> None:
    stub = context_pb2_grpc.ContextStub(
        internal_channel(stack.address("context"), stack.internal_token)
    )
    with pytest.raises(grpc.RpcError) as info:
        stub.AppendTurns(request_, timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert bad_request_fields(info.value) == [field]


def test_context_append_is_idempotent_per_request_id(stack: Stack) -> None:
    turn = context_pb2.Turn(role=context_pb2.ROLE_USER, text="once")
    request = context_pb2.AppendTurnsRequest(
        tenant="t", session_id="idem", request_id="r-1", turns=[turn]
    )
    with internal_channel(stack.address("context"), stack.internal_token) as channel:
        stub = context_pb2_grpc.ContextStub(channel)
        first = stub.AppendTurns(request, timeout=10)
        again = stub.AppendTurns(request, timeout=10)
    assert (first.turn_count, first.appended) == (1, True)
    assert (again.turn_count, again.appended) == (1, False)


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        (
            inference_pb2.InferenceRequest(
                prompt="x", sampling=common_pb2.SamplingParams(max_tokens=1)
            ),
            "model",
        ),
        (
            inference_pb2.InferenceRequest(
                model="llm", sampling=common_pb2.SamplingParams(max_tokens=1)
            ),
            "prompt",
        ),
        (inference_pb2.InferenceRequest(model="llm", prompt="x"), "sampling.max_tokens"),
        (
            inference_pb2.InferenceRequest(
                model="nope", prompt="x", sampling=common_pb2.SamplingParams(max_tokens=1)
            ),
            "model",
        ),
        (
            inference_pb2.InferenceRequest(
                model="llm", prompt="x" * 3000, sampling=common_pb2.SamplingParams(max_tokens=1)
            ),
            "text_input",
        ),
    ],
)
def test_inference_rejects_bad_requests(
    stack: Stack, request_: inference_pb2.InferenceRequest, field: str
) -> None:
    with internal_channel(stack.address("inference"), stack.internal_token) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(request_, timeout=10))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert bad_request_fields(info.value) == [field]


def test_policy_verdict_for_clean_text(stack: Stack) -> None:
    with internal_channel(stack.address("policy"), stack.internal_token) as channel:
        reply = policy_pb2_grpc.PolicyStub(channel).CheckInput(
            policy_pb2.CheckInputRequest(tenant="t", text="Once upon a time"), timeout=10
        )
    assert reply.action == policy_pb2.ACTION_ALLOW
    assert reply.redacted_text == ""  # unchanged: not sent back
    assert reply.rule_set_version


def test_policy_checks_parts_as_one_text_and_reports_where(stack: Stack) -> None:
    with internal_channel(stack.address("policy"), stack.internal_token) as channel:
        stub = policy_pb2_grpc.PolicyStub(channel)

        def check(*texts: str) -> policy_pb2.CheckInputResponse:
            parts = [policy_pb2.InputPart(field=f"m{i}", text=t) for i, t in enumerate(texts)]
            reply: policy_pb2.CheckInputResponse = stub.CheckInput(
                policy_pb2.CheckInputRequest(tenant="t", parts=parts), timeout=10
            )
            return reply

        denied = check("hello", "how to build a", "bomb")
        assert (denied.action, denied.denied_at) == (policy_pb2.ACTION_DENY, "m1")
        assert denied.rule_ids[0] == "deny-weapons"
        redacted = check("mail ada@example.com", "thanks")
        assert redacted.action == policy_pb2.ACTION_REDACT
        assert list(redacted.redacted_parts) == ["mail [EMAIL]", "thanks"]
        assert [(m.rule_id, m.field) for m in redacted.matches] == [("redact-pii", "m0")]
        with pytest.raises(grpc.RpcError) as info:
            stub.CheckInput(
                policy_pb2.CheckInputRequest(text="x", parts=[policy_pb2.InputPart(text="y")]),
                timeout=10,
            )
        assert bad_request_fields(info.value) == ["parts"]


def test_policy_hands_out_rules_and_records_decisions(stack: Stack) -> None:
    with internal_channel(stack.address("policy"), stack.internal_token) as channel:
        stub = policy_pb2_grpc.PolicyStub(channel)
        verdict = stub.CheckInput(policy_pb2.CheckInputRequest(tenant="t", text="x"), timeout=10)
        rules = stub.GetRules(policy_pb2.GetRulesRequest(), timeout=10)
        assert rules.rule_set_version == verdict.rule_set_version
        loaded = [RuleSpec.model_validate(r) for r in json.loads(rules.rules_json)]
        assert {"redact-pii", "deny-weapons"} <= {r.id for r in loaded}
        assert rules.holdback_cap > 0
        watch = stub.WatchRules(policy_pb2.GetRulesRequest(), timeout=10)
        first = next(iter(watch))
        watch.cancel()
        assert first.rules == rules  # the set now, as GetRules has it
        for call in (
            stub.GetRules,
            lambda r, timeout: next(iter(stub.WatchRules(r, timeout=timeout))),
        ):
            with pytest.raises(grpc.RpcError) as info:
                call(policy_pb2.GetRulesRequest(rule_set="nope"), timeout=10)
            assert bad_request_fields(info.value) == ["rule_set"]

        version = rules.rule_set_version
        good = policy_pb2.Decision(
            request_id="r",
            tenant="t",
            stage=policy_pb2.STAGE_INPUT,
            rule_set_version=version,
            action=policy_pb2.ACTION_ALLOW,
        )
        stub.RecordDecisions(policy_pb2.RecordDecisionsRequest(decisions=[good]), timeout=10)
        for bad, field in [
            (policy_pb2.Decision(stage=policy_pb2.STAGE_INPUT, rule_set_version=version), "action"),
            (policy_pb2.Decision(action=policy_pb2.ACTION_DENY, rule_set_version=version), "stage"),
            (
                policy_pb2.Decision(action=policy_pb2.ACTION_DENY, stage=policy_pb2.STAGE_OUTPUT),
                "rule_set_version",
            ),
        ]:
            request = policy_pb2.RecordDecisionsRequest(decisions=[good, bad])
            with pytest.raises(grpc.RpcError) as info:
                stub.RecordDecisions(request, timeout=10)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert bad_request_fields(info.value) == [f"decisions[1].{field}"]


def test_policy_output_stream_redacts_and_refuses_bad_chunks(stack: Stack) -> None:
    with internal_channel(stack.address("policy"), stack.internal_token) as channel:
        check_output = output_checker(channel)
        replies = check_output(
            [
                policy_pb2.CheckOutputRequest(request_id="r", tenant="t", text="write to ada@"),
                policy_pb2.CheckOutputRequest(text="example.com soon"),
                policy_pb2.CheckOutputRequest(final=True),
            ]
        )
        assert "".join(r.text for r in replies) == "write to [EMAIL] soon"
        assert [list(r.rule_ids) for r in replies] == [[], ["redact-pii"], []]
        assert replies[1].action == policy_pb2.ACTION_REDACT
        # A lead (a continued message) is read first and never released.
        lead = policy_pb2.CheckOutputRequest(request_id="r2", tenant="t", lead="mail ada@exa")
        replies = check_output(
            [lead, policy_pb2.CheckOutputRequest(text="mple.com ok", final=True)]
        )
        assert "".join(r.text for r in replies) == "[EMAIL] ok"
        with pytest.raises(grpc.RpcError) as info:
            check_output([policy_pb2.CheckOutputRequest(rule_set="nope", text="x")])
        assert bad_request_fields(info.value) == ["rule_set"]

        raw = channel.stream_stream(
            "/llmmesh.v1.Policy/CheckOutput",
            request_serializer=lambda b: b,
            response_deserializer=lambda b: b,
        )
        with pytest.raises(grpc.RpcError) as info:
            list(raw(iter([b"\x22\x01a", b"\x22\x02\xff\xfe"]), timeout=10))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert bad_request_fields(info.value) == ["text"]


def output_checker(
    channel: grpc.Channel,
) -> Callable[[list[policy_pb2.CheckOutputRequest]], list[policy_pb2.CheckOutputResponse]]:
    stub = policy_pb2_grpc.PolicyStub(channel)

    def call(
        requests: list[policy_pb2.CheckOutputRequest],
    ) -> list[policy_pb2.CheckOutputResponse]:
        return list(stub.CheckOutput(iter(requests), timeout=10))

    return call


def _one_start() -> inference_pb2.MultiplexRequest:
    start = inference_pb2.StartGeneration(
        request=inference_pb2.InferenceRequest(
            model="llm", prompt="hi", sampling=common_pb2.SamplingParams(max_tokens=1)
        )
    )
    control = inference_pb2.GenerationControl(generation_id=1, start=start)
    return inference_pb2.MultiplexRequest(controls=[control])


def test_an_internal_service_refuses_a_local_caller_without_the_mesh_token(stack: Stack) -> None:
    """Without sidecars, any process on the host reaches these ports: none of them answers
    a caller that lacks the launcher's token, not even to list one tenant's sessions."""
    calls: list[tuple[str, Callable[[grpc.Channel], object]]] = [
        (
            "context",
            lambda ch: context_pb2_grpc.ContextStub(ch).ListSessions(
                context_pb2.ListSessionsRequest(tenant="demo"), timeout=10
            ),
        ),
        (
            "policy",
            lambda ch: policy_pb2_grpc.PolicyStub(ch).CheckInput(
                policy_pb2.CheckInputRequest(tenant="demo", text="hi"), timeout=10
            ),
        ),
        (
            "inference",
            lambda ch: next(
                inference_pb2_grpc.InferenceStub(ch).Generate(
                    inference_pb2.InferenceRequest(
                        model="llm", prompt="hi", sampling=common_pb2.SamplingParams(max_tokens=1)
                    ),
                    timeout=10,
                )
            ),
        ),
        (
            "inference",
            lambda ch: next(
                inference_pb2_grpc.InferenceStub(ch).Multiplex(iter([_one_start()]), timeout=10)
            ),
        ),
    ]
    for service, call in calls:
        with grpc.insecure_channel(stack.address(service)) as channel:
            with pytest.raises(grpc.RpcError) as refused:
                call(channel)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED, service
            assert "x-mesh-token" in (refused.value.details() or "")
        with internal_channel(stack.address(service), stack.internal_token) as channel:
            call(channel)  # the same call with the token is answered

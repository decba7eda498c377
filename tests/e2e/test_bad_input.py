"""Bad input gets INVALID_ARGUMENT naming the field, and the services keep serving."""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from llmmesh.client import authorized_channel
from llmmesh.launcher import Stack
from llmmesh.v1 import common_pb2, generation_pb2
from tests.conftest import bad_request_fields, collect
from tests.unit.llmmesh.test_unknown_fields import unknown_varint

CASES: list[tuple[str, dict[str, Any], str]] = [
    ("", {}, "prompt"),
    ("x" * 8193, {}, "prompt"),
    ("x" * 2000, {"max_tokens": 100}, "prompt"),  # prompt + max_tokens exceed the context
    ("hi", {"max_tokens": -1}, "sampling.max_tokens"),
    ("hi", {"max_tokens": 1025}, "sampling.max_tokens"),
    ("hi", {"temperature": -0.5}, "sampling.temperature"),
    ("hi", {"top_p": 0.0}, "sampling.top_p"),
    ("hi", {"top_p": 1.01}, "sampling.top_p"),
    ("hi", {"min_p": 1.5}, "sampling.min_p"),
    ("hi", {"stop_token_ids": [10, 258]}, "sampling.stop_token_ids"),  # the model has 258
    ("hi", {"stop_token_ids": [-1]}, "sampling.stop_token_ids"),
    ("hi", {"allowed_token_ids": [65, 258]}, "sampling.allowed_token_ids"),
    ("hi", {"bad_words": ["ok", ""]}, "sampling.bad_words"),
    # The model's own check: BOS is a token, but never one the output may have.
    ("hi", {"allowed_token_ids": [256]}, "sampling.allowed_token_ids"),
    ("hi", {"session_id": "no spaces allowed"}, "session_id"),
    ("hi", {"stop": [""]}, "sampling.stop"),
    ("hi", {"stop": ["x"] * 17}, "sampling.stop"),
    ("hi", {"seed": -1}, "sampling.seed"),
    ("hi", {"temperature": 1e30}, "sampling.temperature"),
    ("hi", {"presence_penalty": 2.5}, "sampling.presence_penalty"),
    ("hi", {"frequency_penalty": float("nan")}, "sampling.frequency_penalty"),
    ("hi", {"repetition_penalty": -1.0}, "sampling.repetition_penalty"),
    ("hi", {"logit_bias": {300: 1.0}}, "sampling.logit_bias"),  # the model has 258
    ("hi", {"logit_bias": {-2: 1.0}}, "sampling.logit_bias"),
    ("hi", {"logit_bias": {65: float("inf")}}, "sampling.logit_bias"),
    ("hi", {"structured_output": common_pb2.StructuredOutput()}, "sampling.structured_output"),
    (
        "hi",
        {"structured_output": common_pb2.StructuredOutput(json_schema='{"type": 7}')},
        "sampling.structured_output",
    ),
    (
        "hi",
        {"structured_output": common_pb2.StructuredOutput(regex="(")},
        "sampling.structured_output",
    ),
    (
        "hi",
        {"structured_output": common_pb2.StructuredOutput(choice=common_pb2.StructuredChoice())},
        "sampling.structured_output",
    ),
    (
        "hi",
        {
            "structured_output": common_pb2.StructuredOutput(
                choice=common_pb2.StructuredChoice(options=["yes", ""])
            )
        },
        "sampling.structured_output",
    ),
]


@pytest.mark.parametrize(("prompt", "kwargs", "field"), CASES)
def test_invalid_argument_names_the_field(
    router_channel: grpc.Channel, prompt: str, kwargs: dict[str, Any], field: str
) -> None:
    with pytest.raises(grpc.RpcError) as info:
        collect(router_channel, prompt, **kwargs)
    err = info.value
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (err.details() or "").startswith(f"{field}: ")
    assert bad_request_fields(err) == [field]


def test_an_unknown_model_is_not_found_naming_the_field(router_channel: grpc.Channel) -> None:
    with pytest.raises(grpc.RpcError) as info:
        collect(router_channel, "hi", model="gpt-17")
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert (info.value.details() or "").startswith("model: unknown model 'gpt-17'")
    assert bad_request_fields(info.value) == ["model"]


def _raw_field(number: int, payload: bytes) -> bytes:
    return bytes([(number << 3) | 2, len(payload)]) + payload


def test_invalid_utf8_prompt_is_invalid_argument(stack: Stack) -> None:
    with authorized_channel(stack.address("router"), stack.api_key) as channel:
        raw = channel.unary_stream(
            "/llmmesh.v1.Generation/Generate",
            request_serializer=lambda b: b,
            response_deserializer=lambda b: b,
        )
        with pytest.raises(grpc.RpcError) as info:
            list(raw(_raw_field(2, b"caf\xe9 au lait"), timeout=10))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert bad_request_fields(info.value) == ["prompt"]


def test_a_field_this_router_does_not_know_is_refused_not_ignored(stack: Stack) -> None:
    """A client on a newer schema (here, a sampling field number 40) must not have what
    it asked for silently dropped."""
    with authorized_channel(stack.address("router"), stack.api_key) as channel:
        raw = channel.unary_stream(
            "/llmmesh.v1.Generation/Generate",
            request_serializer=lambda b: b,
            response_deserializer=lambda b: b,
        )
        sampling = common_pb2.SamplingParams(max_tokens=3).SerializeToString() + unknown_varint(40)
        request = generation_pb2.GenerateRequest(model="llm", prompt="hi").SerializeToString()
        with pytest.raises(grpc.RpcError) as info:
            list(raw(request + _raw_field(3, sampling), timeout=10))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert bad_request_fields(info.value) == ["sampling"]
    assert "field number 40" in (info.value.details() or "")


def test_service_keeps_serving_after_bad_input(router_channel: grpc.Channel) -> None:
    for prompt, kwargs, _ in CASES:
        with pytest.raises(grpc.RpcError):
            collect(router_channel, prompt, **kwargs)
    assert (
        collect(router_channel, "still here", max_tokens=3, ignore_eos=True)[
            -1
        ].usage.completion_tokens
        == 3
    )

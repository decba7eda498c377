"""A fuzz pass over every RPC of every service, through the real stack: requests built
from each method's request type (every field, its whole range), and raw bytes that may
not even parse. No input may be answered INTERNAL or UNKNOWN, nor UNAVAILABLE: every
service is up, so that would be a client's input taken for an outage (counted against a
replica, and retried by clients); and every service must still serve afterwards. Counts
go to bench/results/fuzz.json."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf.descriptor import MethodDescriptor
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmmesh.client import auth_metadata
from llmmesh.launcher import Stack, StackPorts
from llmmesh.runtime.internal_auth import token_metadata
from llmmesh.v1 import context_pb2, generation_pb2, inference_pb2, policy_pb2
from tests.chaos.proto_strategies import messages
from tests.conftest import wait_for

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results" / "fuzz.json"
EXAMPLES = 120  # per method, of each kind (typed and raw)
FORBIDDEN = {
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.DATA_LOSS,
    grpc.StatusCode.UNAVAILABLE,
}
SERVICES = {
    "router": generation_pb2.DESCRIPTOR.services_by_name["Generation"],
    "context": context_pb2.DESCRIPTOR.services_by_name["Context"],
    "policy": policy_pb2.DESCRIPTOR.services_by_name["Policy"],
    "inference": inference_pb2.DESCRIPTOR.services_by_name["Inference"],
}
METHODS = [(name, method) for name, service in SERVICES.items() for method in service.methods]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with Stack(tmp_path_factory.mktemp("fuzz"), StackPorts.free()) as stack:
        yield stack


@pytest.fixture(scope="module")
def tally() -> Iterator[dict[str, Counter[str]]]:
    counts: dict[str, Counter[str]] = {}
    yield counts
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({k: dict(v) for k, v in counts.items()}, indent=2) + "\n")


def call(channel: grpc.Channel, method: MethodDescriptor, payload: bytes, meta: Any) -> str:
    """The status the service answered ``payload`` with (a stream: its first message)."""
    path = f"/{method.containing_service.full_name}/{method.name}"
    identity = (lambda b: b, lambda b: b)
    try:
        if method.client_streaming:
            stream = channel.stream_stream(path, *identity)
            replies = stream(iter([payload]), metadata=meta, timeout=10)
        elif method.server_streaming:
            replies = channel.unary_stream(path, *identity)(payload, metadata=meta, timeout=10)
        else:
            channel.unary_unary(path, *identity)(payload, metadata=meta, timeout=10)
            return "OK"
        next(replies, None)
        replies.cancel()  # one answer is all it takes; a long generation is not needed
    except grpc.RpcError as err:
        code, details = err.code(), err.details() or ""
        assert code not in FORBIDDEN, (method.full_name, payload[:200], details)
        # An error too long for its trailer reaches the client as this, not as itself.
        assert "metadata size exceeds" not in details, (method.full_name, payload[:200])
        return str(code.name)
    return "OK"


def credentials(stack: Stack, service: str) -> Any:
    if service == "router":
        return (*auth_metadata(stack.api_key), ("x-request-id", "fuzz"))
    return token_metadata(stack.internal_token)


@pytest.mark.parametrize(("service", "method"), METHODS, ids=[m.full_name for _, m in METHODS])
def test_no_input_is_an_internal_error(
    stack: Stack, tally: dict[str, Counter[str]], service: str, method: MethodDescriptor
) -> None:
    request_cls: type[Message] = GetMessageClass(method.input_type)
    counts = tally.setdefault(method.full_name, Counter())
    meta = credentials(stack, service)
    typed = messages(method.input_type, request_cls).map(lambda m: m.SerializeToString())
    with grpc.insecure_channel(stack.address(service)) as channel:

        @settings(
            max_examples=EXAMPLES * 2,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        @given(st.one_of(typed, st.binary(max_size=256)))
        def answered(payload: bytes) -> None:
            counts[call(channel, method, payload, meta)] += 1

        answered()
    wait_for(lambda: _serving(stack), 30, "every service serving after the fuzzing")


def _serving(stack: Stack) -> bool:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    for name in SERVICES:
        with grpc.insecure_channel(stack.address(name)) as channel:
            stub: Any = health_pb2_grpc.HealthStub(channel)
            reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
            if reply.status != health_pb2.HealthCheckResponse.SERVING:
                return False
    return True

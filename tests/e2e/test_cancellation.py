"""A client that goes away cancels the request all the way into Triton's model."""

from __future__ import annotations

import pytest

from llmmesh.client import authorized_channel, build_request
from llmmesh.launcher import Stack
from llmmesh.v1 import generation_pb2_grpc
from tests.conftest import metric_value, wait_for

# What sidecars change (mTLS, RBAC, original-destination routing, each service's calls
# through its sidecar): run again behind them (make test-sidecars).
pytestmark = pytest.mark.sidecars

FINISHED = "llm_engine_requests_finished_total"
GENERATED = "llm_engine_generation_tokens_total"


def test_client_cancel_reaches_the_model(stack: Stack) -> None:
    metrics = f"http://{stack.address('triton_metrics')}/metrics"
    labels = {"model": "llm", "reason": "cancelled"}
    cancelled_before = metric_value(metrics, FINISHED, labels)
    generated_before = metric_value(metrics, GENERATED, {"model": "llm"})

    with authorized_channel(stack.address("router"), stack.api_key) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        call = stub.Generate(build_request("cancel me", max_tokens=1000, ignore_eos=True))
        received = 0
        for reply in call:
            received += len(reply.text)
            if received >= 5:
                call.cancel()
                break

    wait_for(
        lambda: metric_value(metrics, FINISHED, labels) == cancelled_before + 1,
        what="the model to finish the request as cancelled",
    )
    generated = metric_value(metrics, GENERATED, {"model": "llm"}) - generated_before
    assert 5 <= generated < 1000, "the model kept generating after the client cancelled"

"""A router whose endpoint is a Triton server itself: the inference core in the router's
process (services/router/triton_link.py), no inference service between them."""

from __future__ import annotations

import json
from collections.abc import Generator, Iterator
from pathlib import Path

import grpc
import pytest

from llmmesh.client import authorized_channel, build_request
from llmmesh.launcher import Stack, StackPorts
from llmmesh.v1 import common_pb2, generation_pb2_grpc
from tests.conftest import collect, metric_value, start_service, wait_for


def _router_over(
    stack: Stack, tmp_path: Path, triton: str, metrics_url: str
) -> Generator[str, None, None]:
    endpoints = tmp_path / "endpoints.json"
    endpoint = {"address": triton, "triton_metrics_url": metrics_url, "models": ["llm"]}
    endpoints.write_text(json.dumps({"endpoints": [endpoint]}))
    port = StackPorts.free().router
    router = start_service(stack, "router", port, tmp_path, endpoints_file=str(endpoints))
    try:
        yield f"127.0.0.1:{port}"
    finally:
        router.terminate(5)


@pytest.fixture
def router_to_triton(stack: Stack, tmp_path: Path) -> Iterator[str]:
    metrics = f"http://{stack.address('triton_metrics')}/metrics"
    yield from _router_over(stack, tmp_path, stack.address("triton_grpc"), metrics)


def test_streams_from_triton_itself(stack: Stack, router_to_triton: str) -> None:
    with authorized_channel(router_to_triton, stack.api_key) as channel:
        responses = collect(channel, "Once upon a time", max_tokens=12, ignore_eos=True)
    assert responses[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert responses[-1].usage.completion_tokens == 12
    assert "".join(r.text for r in responses)
    assert responses[-1].served.endpoint == stack.address("triton_grpc")


def test_a_cancelled_stream_ends_in_the_engine(stack: Stack, router_to_triton: str) -> None:
    url = f"http://{stack.address('triton_metrics')}/metrics"
    llm = {"model": "llm"}

    def generated() -> float:
        return metric_value(url, "llm_engine_generation_tokens_total", llm)

    def idle() -> bool:  # the engine publishes its counters at once when it goes idle
        return metric_value(url, "llm_engine_running_sequences", llm) == 0

    wait_for(idle, what="the engine idle before the test")
    before = generated()
    with authorized_channel(router_to_triton, stack.api_key) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        call = stub.Generate(build_request("cancel me", max_tokens=1000, ignore_eos=True))
        next(call)  # streaming
        call.cancel()
    wait_for(idle, what="the cancelled generation to end in the engine")
    assert generated() - before < 500  # not the 1000 tokens asked for


def test_triton_down_is_unavailable_and_names_triton(stack: Stack, tmp_path: Path) -> None:
    dead = StackPorts.free()
    routers = _router_over(
        stack,
        tmp_path,
        f"127.0.0.1:{dead.triton_grpc}",
        f"http://127.0.0.1:{dead.triton_metrics}/metrics",
    )
    address = next(routers)
    try:
        with (
            authorized_channel(address, stack.api_key) as channel,
            pytest.raises(grpc.RpcError) as info,
        ):
            collect(channel, "hello", max_tokens=4)
    finally:
        routers.close()
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "Traceback" not in (info.value.details() or "")

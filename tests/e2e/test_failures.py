"""Faults: Triton down, graceful drain on SIGTERM."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from llmmesh.client import authorized_channel, build_request
from llmmesh.launcher import Stack, StackPorts
from llmmesh.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from tests.conftest import collect, start_service


@pytest.fixture
def extra_ports() -> StackPorts:
    return StackPorts.free()


@pytest.fixture
def router_without_triton(stack: Stack, tmp_path: Path, extra_ports: StackPorts) -> Iterator[str]:
    """A router and an inference service whose Triton address has nothing listening."""
    dead_triton = f"127.0.0.1:{extra_ports.triton_grpc}"
    inference = start_service(
        stack, "inference", extra_ports.inference, tmp_path, triton_url=dead_triton
    )
    try:
        router = start_service(
            stack,
            "router",
            extra_ports.router,
            tmp_path,
            endpoints_file="",
            inference_addresses=f'["127.0.0.1:{extra_ports.inference}"]',
        )
        try:
            yield f"127.0.0.1:{extra_ports.router}"
        finally:
            router.terminate(5)
    finally:
        inference.terminate(5)


def test_triton_down_is_unavailable_and_says_so(stack: Stack, router_without_triton: str) -> None:
    with (
        authorized_channel(router_without_triton, stack.api_key) as channel,
        pytest.raises(grpc.RpcError) as info,
    ):
        collect(channel, "hello", max_tokens=4)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    details = info.value.details() or ""
    assert "Triton" in details
    assert "Traceback" not in details and "127.0.0.1" not in details


def test_sigterm_drains_the_stream_in_flight(
    stack: Stack, tmp_path: Path, extra_ports: StackPorts
) -> None:
    address = f"127.0.0.1:{extra_ports.router}"
    router = start_service(stack, "router", extra_ports.router, tmp_path)
    try:
        with authorized_channel(address, stack.api_key) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            call = stub.Generate(build_request("drain", max_tokens=300, ignore_eos=True))
            replies: list[generation_pb2.GenerateResponse] = []
            replies.append(next(call))  # the stream is in flight
            router.process.send_signal(signal.SIGTERM)
            finished = threading.Event()

            def read_rest() -> None:
                replies.extend(call)
                finished.set()

            threading.Thread(target=read_rest, daemon=True).start()
            assert finished.wait(30), "the in-flight stream did not finish"
        assert replies[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert replies[-1].usage.completion_tokens == 300
        assert router.process.wait(30) == 0
    finally:
        router.terminate(5)


def test_an_inference_replicas_sigterm_lets_a_routers_stream_finish(
    stack: Stack, tmp_path: Path, extra_ports: StackPorts
) -> None:
    """The replica drains: the router's stream on it ends whole, and the replica's load
    report stream, which the router watches, ends only after it (a router ends the
    streams on a replica whose reports stop) and does not hold the replica's exit."""
    inference = start_service(stack, "inference", extra_ports.inference, tmp_path)
    router = start_service(
        stack, "router", extra_ports.router, tmp_path,
        endpoints_file="", inference_addresses=f'["127.0.0.1:{extra_ports.inference}"]',
    )  # fmt: skip
    try:
        with authorized_channel(f"127.0.0.1:{extra_ports.router}", stack.api_key) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            call = stub.Generate(build_request("drain me", max_tokens=300, ignore_eos=True))
            replies = [next(call)]  # in flight on the replica
            inference.process.send_signal(signal.SIGTERM)
            replies.extend(call)
        assert replies[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert replies[-1].usage.completion_tokens == 300
        assert inference.process.wait(30) == 0
    finally:
        router.terminate(5)
        inference.terminate(5)

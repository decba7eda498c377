"""A router in front of two inference replicas picks by load."""

from __future__ import annotations

import contextlib
import threading
import time
import urllib.request
from collections.abc import Iterator

import grpc
import pytest

from llmmesh.client import authorized_channel, build_request
from llmmesh.launcher import Stack, StackPorts
from llmmesh.launcher.stack import REPO_MODELS
from llmmesh.launcher.triton import start_triton, wait_until_ready
from llmmesh.v1 import generation_pb2_grpc
from tests.conftest import collect, metric_value, start_service, wait_for

# Tokens of the generation that keeps a replica busy: the engine must still be at it
# (about 2 s here) when the test's later requests have been picked.
LONG_GENERATION = 2000


@pytest.fixture(scope="module")
def two_replicas(
    stack: Stack, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, str, str]]:
    """(router, router metrics URL, second replica): the stack's replica and one more with a
    Triton of its own, behind a router that picks by load."""
    tmp_path = tmp_path_factory.mktemp("replicas")
    ports = StackPorts.free()
    second = f"127.0.0.1:{ports.inference}"
    triton_ports = (ports.triton_grpc, ports.triton_http, ports.triton_metrics)
    log = tmp_path / "triton.log"
    children = [start_triton(tmp_path, REPO_MODELS, "127.0.0.1", triton_ports, log, models=["llm"])]
    try:
        wait_until_ready(children[0], f"127.0.0.1:{ports.triton_grpc}", time.monotonic() + 120)
        children.append(
            start_service(
                stack,
                "inference",
                ports.inference,
                tmp_path,
                triton_url=f"127.0.0.1:{ports.triton_grpc}",
                triton_metrics_url=f"http://127.0.0.1:{ports.triton_metrics}/metrics",
            )
        )
        children.append(
            start_service(
                stack,
                "router",
                ports.router,
                tmp_path,
                metrics_port=str(ports.router_metrics),
                endpoints_file="",
                inference_addresses=f'["{stack.address("inference")}", "{second}"]',
                max_tokens_limit=str(LONG_GENERATION),
            )
        )
        yield (
            f"127.0.0.1:{ports.router}",
            f"http://127.0.0.1:{ports.router_metrics}/metrics",
            second,
        )
    finally:
        for child in reversed(children):
            child.terminate(10)


def test_a_busy_replica_is_passed_over(stack: Stack, two_replicas: tuple[str, str, str]) -> None:
    router, metrics, second = two_replicas
    first = stack.address("inference")

    def picks(address: str) -> float:
        return metric_value(metrics, "llm_router_picks_total", {"endpoint": address})

    def engine_busy() -> float:
        url = f"http://{stack.address('triton_metrics')}/metrics"
        labels = {"model": "llm"}
        return metric_value(url, "llm_engine_running_sequences", labels) + metric_value(
            url, "llm_engine_waiting_sequences", labels
        )

    # Generations left over from earlier tests would make the stack's replica look busy.
    wait_for(lambda: engine_busy() == 0, what="the stack's engine to be idle")

    with authorized_channel(router, stack.api_key) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        long_call = stub.Generate(
            build_request("hold", max_tokens=LONG_GENERATION, ignore_eos=True)
        )

        def first_reply() -> None:
            with contextlib.suppress(grpc.RpcError):  # cancelled below, maybe before a reply
                next(long_call)

        threading.Thread(target=first_reply, daemon=True).start()
        wait_for(lambda: picks(first) + picks(second) == 1, what="the long request's pick")
        busy = first if picks(first) == 1 else second
        # The other replica is idle: the next requests go there, not to the busy one.
        for _ in range(3):
            collect(channel, "short", max_tokens=2)
        assert picks(busy) == 1
        assert picks(second if busy == first else first) == 3
        long_call.cancel()


def test_router_metrics_endpoint_is_up(two_replicas: tuple[str, str, str]) -> None:
    with urllib.request.urlopen(two_replicas[1], timeout=5) as reply:
        assert "llm_router_picks_total" in reply.read().decode()

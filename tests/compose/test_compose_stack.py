"""docker-compose.yml for real: Consul, Triton's image, every service beside its Connect
sidecar. Generation through the router, a session, a canary shift through the real
Consul KV, and intentions refusing a caller that is not the router."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from testcontainers.compose import DockerCompose

from llmmesh.client import authorized_channel
from llmmesh.waiting import poll_until
from tests.conftest import collect

pytestmark = pytest.mark.compose

REPO = Path(__file__).resolve().parents[2]
ROUTER = "127.0.0.1:50051"
KEY = "replace-me"  # the example tenant of mesh/consul/kv/llm-mesh/tenants.yaml


@pytest.fixture(scope="module")
def compose() -> Iterator[DockerCompose]:
    stack = DockerCompose(str(REPO), compose_file_name="docker-compose.yml", build=True)
    with stack:

        def serving() -> bool:  # images pulled, Triton's model loaded, sidecars up
            with authorized_channel(ROUTER, KEY) as channel:
                return bool(collect(channel, "ready?", max_tokens=1, timeout_s=10))

        assert poll_until(serving, 600, interval_s=2), "the compose stack never served"
        yield stack


def test_generation_and_a_session_through_the_mesh(compose: DockerCompose) -> None:
    with authorized_channel(ROUTER, KEY) as channel:
        first = collect(channel, "hello", max_tokens=4, session_id="compose")
        second = collect(channel, "again", max_tokens=4, session_id="compose")
    assert first[-1].usage.completion_tokens == 4
    assert second[-1].usage.prompt_tokens > first[-1].usage.prompt_tokens


def test_a_canary_shift_through_consul_kv_applies_within_a_second(
    compose: DockerCompose,
) -> None:
    def canary(*args: str) -> None:
        subprocess.run(
            [sys.executable, "-m", "llmmesh.cli", "canary", *args, "--consul", "127.0.0.1:8500"],
            check=True,
            timeout=30,
        )

    try:
        with authorized_channel(ROUTER, KEY) as channel:
            canary("set", "--weight", "canary=100")
            written = time.monotonic()
            while collect(channel, "hi", max_tokens=1)[-1].served.subset != "canary":
                assert time.monotonic() - written < 1.0
    finally:
        canary("set", "--weight", "canary=0")


PROBE = """
import grpc
from llmmesh.v1 import inference_pb2, inference_pb2_grpc
for address in ("inference-stable:50061", "inference-stable:21000"):
    with grpc.insecure_channel(address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        try:
            next(stub.WatchLoad(inference_pb2.WatchLoadRequest(), timeout=5))
            print(address, "OK")
        except grpc.RpcError as err:
            print(address, err.code().name)
"""


def test_inference_is_reachable_only_through_the_mesh(compose: DockerCompose) -> None:
    # From the policy container: the service itself listens on its pod's loopback only,
    # and its sidecar takes nothing but mTLS from a mesh identity.
    out = compose.exec_in_container(["python", "-c", PROBE], service_name="policy")
    text = str(out)
    assert "inference-stable:50061 UNAVAILABLE" in text
    assert "inference-stable:21000 UNAVAILABLE" in text

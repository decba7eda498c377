"""Session-wide fixtures: one real local stack (Triton + the four services) for e2e tests."""

from __future__ import annotations

import os
import subprocess
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from prometheus_client.parser import text_string_to_metric_families

from llmmesh.client import authorized_channel, build_request
from llmmesh.launcher import Stack, StackPorts
from llmmesh.launcher.process import Child
from llmmesh.launcher.redis import start_redis
from llmmesh.v1 import generation_pb2, generation_pb2_grpc
from llmmesh.waiting import poll_until


def wait_for(
    condition: Callable[[], bool], timeout_s: float = 30.0, what: str = "condition"
) -> None:
    """Fails the test unless ``condition`` holds within ``timeout_s``."""
    if not poll_until(condition, timeout_s):
        pytest.fail(f"timed out after {timeout_s}s waiting for {what}")


# LLM_MESH_TEST_SIDECARS=1 runs the end-to-end suite against the stack with an Envoy
# sidecar beside every service (mTLS, RBAC from mesh/consul's intentions).
SIDECARS = os.environ.get("LLM_MESH_TEST_SIDECARS") == "1"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """A failed test that used a stack gets the warnings and errors its services logged
    (the logs stay in pytest's temporary directory, which a CI run does not keep)."""
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    used = getattr(item, "funcargs", {}).get("stack")
    if report.failed and isinstance(used, Stack):
        report.sections.append(("stack logs: warnings and errors", stack_complaints(used)))


def stack_complaints(stack: Stack, last: int = 12) -> str:
    lines = []
    for log in sorted((stack.workdir / "logs").glob("*.log")):
        said = [
            line[:400]
            for line in log.read_text(errors="replace").splitlines()
            if '"level": "WARNING"' in line or '"level": "ERROR"' in line
        ]
        lines += [f"{log.name}: {line}" for line in said[-last:]]
    return "\n".join(lines) or "none"


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    workdir: Path = tmp_path_factory.mktemp("stack")
    with Stack(workdir, StackPorts.free(), sidecars=SIDECARS) as running:
        yield running


@dataclass(frozen=True)
class RedisServer:
    url: str
    port: int
    workdir: Path
    child: Child


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """Debian's redis-server on a free port, appendfsync always (tests use key prefixes
    of their own)."""
    workdir: Path = tmp_path_factory.mktemp("redis")
    port = StackPorts.free().context
    child = start_redis(workdir, port)
    try:
        yield RedisServer(f"redis://127.0.0.1:{port}/0", port, workdir, child)
    finally:
        child.terminate(5)


@pytest.fixture(scope="session")
def router_channel(stack: Stack) -> Iterator[grpc.Channel]:
    with authorized_channel(stack.address("router"), stack.api_key) as channel:
        yield channel


def collect(
    channel: grpc.Channel, prompt: str, timeout_s: float = 60.0, **kwargs: Any
) -> list[generation_pb2.GenerateResponse]:
    """Every response of one Generate stream."""
    stub = generation_pb2_grpc.GenerationStub(channel)
    return list(stub.Generate(build_request(prompt, **kwargs), timeout=timeout_s))


def text_of(responses: list[generation_pb2.GenerateResponse]) -> str:
    return "".join(r.text for r in responses)


def bad_request_fields(err: grpc.RpcError) -> list[str]:
    """Field names in the google.rpc.BadRequest detail of an error status."""
    status = rpc_status.from_call(err)  # type: ignore[arg-type]
    fields: list[str] = []
    for detail in status.details if status else ():
        if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            fields += [v.field for v in bad.field_violations]
    return fields


def metric_value(url: str, name: str, labels: dict[str, str]) -> float:
    """One sample from a Prometheus text endpoint (0 when absent)."""
    with urllib.request.urlopen(url, timeout=5) as reply:
        text = reply.read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return 0.0


def prompt_tokens_seen(stack: Stack) -> float:
    """Prompt tokens every engine admitted so far (Triton's llm_engine_* counters)."""
    url = f"http://{stack.address('triton_metrics')}/metrics"
    with urllib.request.urlopen(url, timeout=5) as reply:
        text = reply.read().decode()
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "llm_engine_prompt_tokens_total"
    )


def backend_pids(stack: Stack) -> dict[str, int]:
    """Triton's live Python-backend processes, by model instance (e.g. llm_0_0)."""
    listing = subprocess.run(
        ["ps", "-ww", "-o", "pid=,stat=,args=", "--ppid", str(stack.pids()["triton"])],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    found: dict[str, int] = {}
    for line in listing.splitlines():
        pid, stat, *args = line.split()
        if "triton_python_backend_stub" in line and not stat.startswith("Z"):
            found[args[-2]] = int(pid)
    return found


def assert_engines_saw_only(stack: Stack, before: float, allowed: Callable[[], int]) -> None:
    """After refused requests, one allowed request (``allowed`` returns its prompt tokens)
    moves the engines' prompt-token counter by exactly its own prompt: none of the
    refused ones reached an engine."""
    expected = before + allowed()
    wait_for(lambda: prompt_tokens_seen(stack) == expected, 10, "the allowed prompt's tokens")
    assert prompt_tokens_seen(stack) == expected


def start_service(stack: Stack, name: str, port: int, tmp_path: Path, **overrides: str) -> Child:
    """Another instance of a stack service on ``port``, its settings overridden."""
    return stack.start_service(name, port, tmp_path, **overrides)

"""Every service: health checking, reflection, Prometheus metrics, structured logs."""

from __future__ import annotations

import json
import urllib.request
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from llmmesh.launcher import Stack

SERVICES = {
    "router": "llmmesh.v1.Generation",
    "inference": "llmmesh.v1.Inference",
    "policy": "llmmesh.v1.Policy",
    "context": "llmmesh.v1.Context",
}


@pytest.mark.parametrize(("name", "grpc_service"), SERVICES.items())
def test_health_reports_serving(stack: Stack, name: str, grpc_service: str) -> None:
    with grpc.insecure_channel(stack.address(name)) as channel:
        stub: Any = health_pb2_grpc.HealthStub(channel)
        for service in ("", grpc_service):
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.parametrize(("name", "grpc_service"), SERVICES.items())
def test_reflection_lists_the_service(stack: Stack, name: str, grpc_service: str) -> None:
    with grpc.insecure_channel(stack.address(name)) as channel:
        stub: Any = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        reply = next(iter(stub.ServerReflectionInfo(iter([request]), timeout=5)))
    names = {s.name for s in reply.list_services_response.service}
    assert {grpc_service, "grpc.health.v1.Health"} <= names


@pytest.mark.parametrize(
    ("name", "metric"),
    [
        ("router", "gen_ai_server_time_to_first_token_seconds"),
        ("inference", "gen_ai_server_time_per_output_token_seconds"),
        ("policy", "llm_policy_decisions_total"),
        ("context", "llm_context_load_seconds"),
    ],
)
def test_metrics_endpoint(stack: Stack, name: str, metric: str) -> None:
    url = f"http://{stack.address(name + '_metrics')}/metrics"
    with urllib.request.urlopen(url, timeout=5) as reply:
        assert metric in reply.read().decode()


def test_logs_are_json_lines_with_the_request_id(
    stack: Stack, router_channel: grpc.Channel
) -> None:
    from tests.conftest import collect

    with pytest.raises(grpc.RpcError):
        collect(router_channel, "how to build a bomb", max_tokens=2)
    lines = stack.log_path("policy").read_text().splitlines()
    entries = [json.loads(line) for line in lines if line.startswith("{")]
    matches = [e for e in entries if e["msg"] == "policy match"]
    assert matches and matches[-1]["request_id"] and matches[-1]["service"] == "policy"


def test_router_logs_each_generation_with_its_request_id(
    stack: Stack, router_channel: grpc.Channel
) -> None:
    from tests.conftest import collect

    # ignore_eos: the tiny model, sampling, may end before its third token.
    request_id = collect(router_channel, "log me", max_tokens=3, ignore_eos=True)[0].request_id
    entries = [
        json.loads(line)
        for line in stack.log_path("router").read_text().splitlines()
        if line.startswith("{")
    ]
    ended = [e for e in entries if e.get("request_id") == request_id]
    assert [e["msg"] for e in ended] == ["generation ended"]
    assert ended[0]["outcome"] == "length" and ended[0]["completion_tokens"] == 3


@pytest.mark.parametrize("name", SERVICES)
def test_start_up_heap_frozen_and_collector_pauses_exported(stack: Stack, name: str) -> None:
    entries = [
        json.loads(line)
        for line in stack.log_path(name).read_text().splitlines()
        if line.startswith("{")
    ]
    frozen = [e for e in entries if e["msg"] == "start-up heap frozen"]
    assert frozen and frozen[-1]["objects"] > 10_000  # imports alone are tens of thousands
    url = f"http://{stack.address(name + '_metrics')}/metrics"
    with urllib.request.urlopen(url, timeout=5) as reply:
        page = reply.read().decode()
    for generation in range(3):
        assert f'llm_gc_pause_seconds_total{{generation="{generation}"}}' in page

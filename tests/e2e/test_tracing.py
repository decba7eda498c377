"""Tracing across the mesh: one trace per request, from the router through policy,
context and inference, received by an OTLP collector (an in-process gRPC TraceService)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from llmmesh.client import authorized_channel
from llmmesh.launcher import Stack, StackPorts
from llmmesh.launcher.process import Child
from tests.conftest import collect, start_service, wait_for


@dataclass(frozen=True)
class Span:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    recorded: str  # everything else the span holds: status, events, attributes


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.spans: list[Span] = []
        self._lock = threading.Lock()

    def Export(  # noqa: N802 (gRPC method name)
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: object
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        with self._lock:
            for resource_spans in request.resource_spans:
                attributes = {
                    a.key: a.value.string_value for a in resource_spans.resource.attributes
                }
                service = attributes.get("service.name", "")
                for scope in resource_spans.scope_spans:
                    self.spans += [
                        Span(
                            service,
                            s.name,
                            s.trace_id.hex(),
                            s.span_id.hex(),
                            s.parent_span_id.hex(),
                            f"{s.status} {list(s.events)} {list(s.attributes)}",
                        )
                        for s in scope.spans
                    ]
        return trace_service_pb2.ExportTraceServiceResponse()


@pytest.fixture(scope="module")
def traced(
    stack: Stack, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, Collector]]:
    """A collector, and a router, policy, context and inference exporting to it."""
    tmp: Path = tmp_path_factory.mktemp("tracing")
    collector = Collector()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, server)  # type: ignore[no-untyped-call]
    otlp_port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    otlp = {"otlp_endpoint": f"127.0.0.1:{otlp_port}"}
    ports = StackPorts.free()
    children: list[Child] = []
    try:
        for name in ("policy", "context"):
            children.append(start_service(stack, name, getattr(ports, name), tmp, **otlp))
        children.append(start_service(stack, "inference", ports.inference, tmp, **otlp))
        endpoints = tmp / "endpoints.json"
        endpoints.write_text(
            json.dumps({"endpoints": [{"address": f"127.0.0.1:{ports.inference}"}]})
        )
        children.append(
            start_service(
                stack,
                "router",
                ports.router,
                tmp,
                endpoints_file=str(endpoints),
                policy_address=f"127.0.0.1:{ports.policy}",
                context_address=f"127.0.0.1:{ports.context}",
                **otlp,
            )
        )
        yield f"127.0.0.1:{ports.router}", collector
    finally:
        for child in reversed(children):
            child.terminate(5)
        server.stop(None)


def test_one_trace_spans_the_mesh(stack: Stack, traced: tuple[str, Collector]) -> None:
    address, collector = traced
    with authorized_channel(address, stack.api_key) as channel:
        responses = collect(channel, "hello", max_tokens=4, session_id="traced", ignore_eos=True)
    assert responses[-1].usage.completion_tokens == 4
    wanted = {
        "/llmmesh.v1.Generation/Generate",
        "admission.wait",
        "context.load",
        "policy.check_input",
        "endpoint.pick",
        "inference.first_token",
        "/llmmesh.v1.Policy/CheckInput",
        "/llmmesh.v1.Context/LoadSession",
        "/llmmesh.v1.Context/AppendTurns",
        "/llmmesh.v1.Inference/Generate",
    }
    wait_for(lambda: wanted <= {s.name for s in collector.spans}, 15, "every span exported")
    root = next(s for s in collector.spans if s.name == "/llmmesh.v1.Generation/Generate")
    spans = {s.name: s for s in collector.spans if s.trace_id == root.trace_id}
    assert wanted <= set(spans)  # one trace
    # Each service's span hangs under the router's step that called it.
    assert spans["/llmmesh.v1.Policy/CheckInput"].parent_id == spans["policy.check_input"].span_id
    assert spans["/llmmesh.v1.Context/LoadSession"].parent_id == spans["context.load"].span_id
    assert (
        spans["/llmmesh.v1.Inference/Generate"].parent_id == spans["inference.first_token"].span_id
    )
    assert spans["policy.check_input"].parent_id == root.span_id
    assert {s.service for s in spans.values()} == {
        "llm-mesh-router",
        "llm-mesh-policy",
        "llm-mesh-context",
        "llm-mesh-inference",
    }


def test_a_failed_call_records_what_failed_never_what_was_sent(
    stack: Stack, traced: tuple[str, Collector]
) -> None:
    """An error's message may quote the request (a bad field's value): a span records the
    error's kind, and a trace backend never holds what the tenant sent unchecked."""
    address, collector = traced
    secret = "4111 1111 1111 1111"
    with (
        authorized_channel(address, stack.api_key) as channel,
        pytest.raises(grpc.RpcError) as refused,
    ):
        collect(channel, "hello", model=secret, max_tokens=2)
    assert refused.value.code() == grpc.StatusCode.NOT_FOUND
    assert secret in str(refused.value.details())  # the caller is told which value

    def failed() -> list[Span]:
        name = "/llmmesh.v1.Generation/Generate"
        return [s for s in collector.spans if s.name == name and "ERROR" in s.recorded]

    wait_for(lambda: bool(failed()), 15, "the failed call's span exported")
    assert "NOT_FOUND" in failed()[0].recorded and "error.type" in failed()[0].recorded
    assert not [s.recorded for s in collector.spans if secret in s.recorded]

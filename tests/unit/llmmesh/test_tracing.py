"""Trace context across a process that exports no spans: nothing is carried on without a
caller's trace, and a caller's trace is carried on unchanged (sidecars join it)."""

from __future__ import annotations

import pytest
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from llmmesh.runtime import tracing
from llmmesh.runtime.errors import InvalidArgument

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
TRACEPARENT = f"00-{TRACE_ID}-b7ad6b7169203331-01"


def _carried_from(metadata: object) -> dict[str, str]:
    """What a call made under a server span started from ``metadata`` carries on."""
    parent = tracing.incoming(metadata)  # type: ignore[arg-type]
    span = tracing.tracer.start_span("server", context=parent)
    token = otel_context.attach(trace.set_span_in_context(span, parent))
    try:
        return dict(tracing.outgoing())
    finally:
        otel_context.detach(token)


def test_a_call_without_a_trace_carries_none_on() -> None:
    metadata = (("authorization", "Bearer key"), ("x-request-id", "r1"))
    assert tracing.incoming(metadata) == otel_context.Context()
    assert _carried_from(metadata) == {}


def test_a_callers_trace_is_carried_on_from_grpc_metadata_and_http_headers() -> None:
    grpc_metadata = (("x-request-id", "r1"), ("traceparent", TRACEPARENT))
    http_headers = {"Traceparent": TRACEPARENT, "Baggage": "tier=critical"}
    assert _carried_from(grpc_metadata) == {"traceparent": TRACEPARENT}
    carried = _carried_from(http_headers)
    assert carried["traceparent"] == TRACEPARENT and carried["baggage"] == "tier=critical"


def test_a_span_records_an_errors_kind_never_its_message() -> None:
    """An error's message may quote a request's bad value: the span holds its code."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()  # this test's own: the process's stays unset
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    span = provider.get_tracer("test").start_span("call")
    with pytest.raises(InvalidArgument), tracing.using(span, end_on_exit=True):
        raise InvalidArgument("card", "got '4111 1111 1111 1111'")
    (ended,) = exporter.get_finished_spans()
    assert ended.status.status_code is trace.StatusCode.ERROR
    assert ended.status.description == "INVALID_ARGUMENT"
    assert dict(ended.attributes or {}) == {"error.type": "INVALID_ARGUMENT"}
    assert not ended.events  # no exception event: its message and stack stay out

"""Trace context across a process that exports no spans: nothing is carried on without a
caller's trace, and a caller's trace is carried on unchanged (sidecars join it)."""

from __future__ import annotations

from opentelemetry import context as otel_context
from opentelemetry import trace

from llmmesh.runtime import tracing

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

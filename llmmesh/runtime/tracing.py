"""OpenTelemetry tracing across the mesh: W3C ``traceparent`` carried in gRPC metadata
(and HTTP headers), a server span per call, spans for the router's steps, exported over
OTLP when ``otlp_endpoint`` is set.

Off by default, and then free: the API's no-op tracer makes spans that record nothing,
nothing is injected into calls (there is no valid span context to carry), and a
request's steps start no span at all (``step``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping
from contextlib import AbstractContextManager

from opentelemetry import propagate, trace
from opentelemetry.context import Context

from llmmesh.runtime.errors import MeshError

tracer = trace.get_tracer("llm-mesh")
# The names a caller's trace context and baggage come under (W3C): a call without them
# has nothing to extract, and the propagators need not run.
_CARRIED = frozenset({"traceparent", "tracestate", "baggage"})


def configure(service: str, otlp_endpoint: str) -> None:
    """Exports this process's spans to ``otlp_endpoint`` (OTLP/gRPC, host:port)."""
    if not otlp_endpoint:
        return
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": f"llm-mesh-{service}"}))
    exporter = OTLPSpanExporter(endpoint=otlp_endpoint, insecure=True)
    provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=200))
    trace.set_tracer_provider(provider)


def recording() -> bool:
    """Whether this process records spans (a tracer provider of the SDK is set)."""
    return not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)


def wanted(parent: Context) -> bool:
    """Whether a call's server span is worth starting: this process records spans, or the
    caller sent a trace (``parent``) that what the call does must carry on."""
    return bool(parent) or recording()


def step(name: str) -> AbstractContextManager[trace.Span | None]:
    """A span around one step of a request, current while it runs; none (``None``) when
    this process records no spans. A no-op span would only carry its parent's context on,
    which stays current anyway, and on a path gone cold it costs as much as a small step
    (docs/benchmarks.md, "One call set-up less")."""
    if recording():
        return current_span(name)
    return contextlib.nullcontext()


def current_span(
    name: str, context: Context | None = None, kind: trace.SpanKind = trace.SpanKind.INTERNAL
) -> AbstractContextManager[trace.Span]:
    """A new span, current while the block runs and ended after it (``using``)."""
    return using(tracer.start_span(name, context, kind), end_on_exit=True)


@contextlib.contextmanager
def using(span: trace.Span, end_on_exit: bool) -> Iterator[trace.Span]:
    """``span`` current while the block runs; an error that ends the block is recorded by
    its kind only (``failed``), not as OpenTelemetry records an exception."""
    with trace.use_span(
        span, end_on_exit=end_on_exit, record_exception=False, set_status_on_exception=False
    ):
        try:
            yield span
        except Exception as err:
            failed(span, err)
            raise


def failed(span: trace.Span, err: BaseException) -> None:
    """Marks ``span`` as failed by ``err``'s kind (its gRPC code, for the mesh's errors):
    an error's message may quote what the tenant sent (a field's bad value), which a trace
    backend must not hold, and its stack says nothing an operator needs from a trace."""
    kind = err.code if isinstance(err, MeshError) else type(err).__name__
    span.set_attribute("error.type", kind)
    span.set_status(trace.Status(trace.StatusCode.ERROR, kind))


def shutdown() -> None:
    """Flushes spans not exported yet (on SIGTERM)."""
    provider = trace.get_tracer_provider()
    if hasattr(provider, "shutdown"):  # the SDK's, when configured
        provider.shutdown()


def outgoing() -> tuple[tuple[str, str], ...]:
    """Metadata that carries the current trace to the callee (none without a trace)."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return tuple(carrier.items())


def incoming(metadata: Iterable[tuple[str, str | bytes]] | Mapping[str, str]) -> Context:
    """The caller's trace context, from gRPC metadata or HTTP headers (an empty one when
    the caller sent none). Spans started from it carry the caller's trace on even when
    this process exports none: a service mesh's sidecars join their spans that way."""
    items = metadata.items() if isinstance(metadata, Mapping) else metadata
    carrier = {k.lower(): v for k, v in items if isinstance(v, str)}
    if _CARRIED.isdisjoint(carrier):
        return Context()
    return propagate.extract(carrier)

"""Registers a servicer from its service descriptor, with what every method shares:
lenient request decoding, a server span, and core errors mapped to statuses.

Generated ``add_*Servicer_to_server`` functions fail a request that does not parse (for
example invalid UTF-8 in a string field) with a bare INTERNAL status. Here such a request
reaches no handler: the client gets INVALID_ARGUMENT naming the offending field. A
``MeshError`` a handler raises ends the call with its status and rich details
(grpc_status.abort), so servicers translate and never catch.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf import descriptor, message, message_factory
from opentelemetry import context as otel_context
from opentelemetry import trace

from llmmesh.runtime import tracing
from llmmesh.runtime.errors import InvalidArgument, MeshError
from llmmesh.runtime.grpc_status import abort
from llmmesh.runtime.metadata import REQUEST_ID, bind_request_id, metadata_value


@dataclass(frozen=True)
class MalformedRequest:
    error: InvalidArgument


def add_servicer(
    server: grpc.aio.Server, servicer: object, service: descriptor.ServiceDescriptor
) -> None:
    handlers = {
        method.name: _handler(getattr(servicer, method.name), method) for method in service.methods
    }
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(service.full_name, handlers),)
    )


def _handler(
    behaviour: Callable[..., Any], method: descriptor.MethodDescriptor
) -> grpc.RpcMethodHandler[Any, Any]:
    request_cls = message_factory.GetMessageClass(method.input_type)
    response_cls = message_factory.GetMessageClass(method.output_type)
    deserialize = _lenient(request_cls)
    serialize = response_cls.SerializeToString
    behaviour = _traced(behaviour, method)
    if method.client_streaming and method.server_streaming:
        return grpc.stream_stream_rpc_method_handler(
            _checked_bidi(behaviour),
            request_deserializer=deserialize,
            response_serializer=serialize,
        )
    if method.client_streaming:
        raise NotImplementedError(f"{method.full_name}: client streaming is not registered here")
    if method.server_streaming:
        return grpc.unary_stream_rpc_method_handler(
            _checked_stream(behaviour),
            request_deserializer=deserialize,
            response_serializer=serialize,
        )
    return grpc.unary_unary_rpc_method_handler(
        _checked_unary(behaviour), request_deserializer=deserialize, response_serializer=serialize
    )


def _traced(
    behaviour: Callable[..., Any], method: descriptor.MethodDescriptor
) -> Callable[..., Any]:
    """The handler inside a server span, child of the caller's (traceparent metadata),
    with the caller's x-request-id bound for its log lines (a handler may bind the id its
    request message carries instead)."""
    name = f"/{method.containing_service.full_name}/{method.name}"
    kind = trace.SpanKind.SERVER

    if method.server_streaming:

        async def streaming(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            _bind_callers_request_id(context)
            parent = tracing.incoming(context.invocation_metadata() or ())
            span = tracing.tracer.start_span(name, context=parent, kind=kind)
            # Current for the rest of the call's own task and never detached: a stream
            # the client cancels is closed from another context, where a detach fails.
            otel_context.attach(trace.set_span_in_context(span, parent))
            try:
                async for response in behaviour(request, context):
                    yield response
            except Exception as err:
                span.record_exception(err)
                span.set_status(trace.Status(trace.StatusCode.ERROR, str(err)))
                raise
            finally:
                span.end()

        return streaming

    async def unary(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        _bind_callers_request_id(context)
        parent = tracing.incoming(context.invocation_metadata() or ())
        with tracing.tracer.start_as_current_span(name, context=parent, kind=kind):
            return await behaviour(request, context)

    return unary


def _bind_callers_request_id(context: grpc.aio.ServicerContext[Any, Any]) -> None:
    given = metadata_value(context, REQUEST_ID)
    if given:
        bind_request_id(context, given)


def _lenient(cls: type[message.Message]) -> Callable[[bytes], object]:
    def deserialize(data: bytes) -> object:
        try:
            return cls.FromString(data)
        except message.DecodeError:
            return MalformedRequest(_diagnose(cls.DESCRIPTOR, data))

    return deserialize


def _checked_unary(behaviour: Callable[..., Any]) -> Callable[..., Any]:
    async def handle(request: object, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        if isinstance(request, MalformedRequest):
            await abort(context, request.error)
        try:
            return await behaviour(request, context)
        except MeshError as err:
            await abort(context, err)

    return handle


def _checked_stream(
    behaviour: Callable[..., AsyncIterator[Any]],
) -> Callable[..., AsyncIterator[Any]]:
    async def handle(
        request: object, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[Any]:
        if isinstance(request, MalformedRequest):
            await abort(context, request.error)
        try:
            async for response in behaviour(request, context):
                yield response
        except MeshError as err:
            await abort(context, err)

    return handle


def _checked_bidi(
    behaviour: Callable[..., AsyncIterator[Any]],
) -> Callable[..., AsyncIterator[Any]]:
    async def handle(
        requests: AsyncIterator[object], context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[Any]:
        async def checked() -> AsyncIterator[object]:
            async for request in requests:
                if isinstance(request, MalformedRequest):
                    await abort(context, request.error)
                yield request

        try:
            async for response in behaviour(checked(), context):
                yield response
        except MeshError as err:
            await abort(context, err)

    return handle


def _diagnose(desc: Any, data: bytes, prefix: str = "") -> InvalidArgument:
    """Finds the string field that is not UTF-8 by walking the wire format."""
    found = _invalid_utf8_field(desc, data, prefix)
    if found:
        return InvalidArgument(found, "not valid UTF-8")
    return InvalidArgument("request", "cannot be parsed as " + desc.full_name)


def _invalid_utf8_field(desc: Any, data: bytes, prefix: str) -> str | None:
    for number, payload in _length_delimited_fields(data):
        field = desc.fields_by_number.get(number)
        if field is None:
            continue
        path = f"{prefix}{field.name}"
        if field.type == descriptor.FieldDescriptor.TYPE_STRING:
            try:
                payload.decode("utf-8")
            except UnicodeDecodeError:
                return path
        elif field.type == descriptor.FieldDescriptor.TYPE_MESSAGE:
            nested = _invalid_utf8_field(field.message_type, payload, path + ".")
            if nested:
                return nested
    return None


def _length_delimited_fields(data: bytes) -> list[tuple[int, bytes]]:
    """(field number, payload) of every length-delimited field; stops at malformed input."""
    out, pos = [], 0
    try:
        while pos < len(data):
            key, pos = _varint(data, pos)
            number, wire_type = key >> 3, key & 7
            if wire_type == 0:
                _, pos = _varint(data, pos)
            elif wire_type == 1:
                pos += 8
            elif wire_type == 5:
                pos += 4
            elif wire_type == 2:
                size, pos = _varint(data, pos)
                out.append((number, data[pos : pos + size]))
                pos += size
            else:
                break
    except IndexError:
        pass
    return out


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7

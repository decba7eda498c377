"""Registers a servicer from its service descriptor, with what every method shares:
lenient request decoding, a server span, and core errors mapped to statuses.

Generated ``add_*Servicer_to_server`` functions fail a request that does not parse (for
example invalid UTF-8 in a string field) with a bare INTERNAL status. Here such a request
reaches no handler: the client gets INVALID_ARGUMENT naming the offending field. So does a
request with a field this schema does not have (a client on a newer one), which protobuf
would keep aside unread. A
``MeshError`` a handler raises ends the call with its status and rich details
(grpc_status.abort), so servicers translate and never catch.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
from google.protobuf import descriptor, message, message_factory
from google.protobuf.unknown_fields import UnknownFieldSet
from opentelemetry import context as otel_context
from opentelemetry import trace

from llmmesh.runtime import tracing
from llmmesh.runtime.errors import InvalidArgument, MeshError
from llmmesh.runtime.grpc_status import abort
from llmmesh.runtime.metadata import REQUEST_ID, bind_request_id, metadata_value

F = TypeVar("F", bound=Callable[..., Any])
TAKES_MALFORMED = "_takes_malformed_requests"


@dataclass(frozen=True)
class MalformedRequest:
    error: InvalidArgument
    data: bytes  # the message as it came
    # The message, where it parsed and only has fields this schema does not have.
    parsed: Any = None


def takes_malformed(behaviour: F) -> F:
    """Marks a bidi method that handles a message that does not parse itself (it gets a
    ``MalformedRequest`` in its place) rather than having the stream end with the error:
    a stream of many generations refuses the one the message would have started."""
    setattr(behaviour, TAKES_MALFORMED, True)
    return behaviour


def generation_ids(data: bytes) -> list[int]:
    """The ``generation_id`` of each control a multiplexed stream's message (its field 1,
    ``controls``; a control's field 1, ``generation_id``) names, read from the wire
    format of a message that does not parse."""
    return [
        number
        for control in _length_delimited_fields(data)
        if control[0] == 1
        for number in _varint_fields(control[1], 1)
    ]


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
    takes_malformed = getattr(behaviour, TAKES_MALFORMED, False)
    behaviour = _traced(behaviour, method)
    if method.client_streaming and method.server_streaming:
        return grpc.stream_stream_rpc_method_handler(
            _checked_bidi(behaviour, takes_malformed),
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
            if not tracing.wanted(parent):
                async for response in behaviour(request, context):
                    yield response
                return
            span = tracing.tracer.start_span(name, context=parent, kind=kind)
            # Current for the rest of the call's own task and never detached: a stream
            # the client cancels is closed from another context, where a detach fails.
            otel_context.attach(trace.set_span_in_context(span, parent))
            try:
                async for response in behaviour(request, context):
                    yield response
            except Exception as err:
                tracing.failed(span, err)
                raise
            finally:
                span.end()

        return streaming

    async def unary(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        _bind_callers_request_id(context)
        parent = tracing.incoming(context.invocation_metadata() or ())
        with tracing.current_span(name, parent, kind):
            return await behaviour(request, context)

    return unary


def _bind_callers_request_id(context: grpc.aio.ServicerContext[Any, Any]) -> None:
    given = metadata_value(context, REQUEST_ID)
    if given:
        bind_request_id(context, given)


def _lenient(cls: type[message.Message]) -> Callable[[bytes], object]:
    def deserialize(data: bytes) -> object:
        try:
            request = cls.FromString(data)
        except message.DecodeError:
            return MalformedRequest(_diagnose(cls.DESCRIPTOR, data), data)
        # Fields this schema does not have (a newer client's) would be ignored unread:
        # refused instead. Dropping them and comparing sizes is the cheap test (~1 µs);
        # only a difference is walked, on a copy that still has them.
        request.DiscardUnknownFields()
        if request.ByteSize() == len(data):
            return request
        whole = cls.FromString(data)
        unknown = unknown_field(whole)
        return request if unknown is None else MalformedRequest(unknown, data, whole)

    return deserialize


def unknown_field(request: message.Message, path: str = "") -> InvalidArgument | None:
    """The refusal of the first field of ``request`` (or of a message in it) that this
    schema does not have, naming the message that has it by its path from ``request``
    (``request`` itself by its type's name); None if there is none."""
    unknown = UnknownFieldSet(request)
    if len(unknown):
        number = unknown[0].field_number
        where = path or request.DESCRIPTOR.name
        return InvalidArgument(where, f"has field number {number}, which this server does not know")
    for field, value in request.ListFields():
        if field.type != descriptor.FieldDescriptor.TYPE_MESSAGE or field.message_type is None:
            continue
        name = f"{path}.{field.name}" if path else field.name
        if field.message_type.GetOptions().map_entry:
            items = [(f"{name}[{key!r}]", item) for key, item in value.items()]
        elif field.is_repeated:
            items = [(f"{name}[{index}]", item) for index, item in enumerate(value)]
        else:
            items = [(name, value)]
        for item_path, item in items:
            found = unknown_field(item, item_path) if isinstance(item, message.Message) else None
            if found is not None:
                return found
    return None


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
    behaviour: Callable[..., AsyncIterator[Any]], takes_malformed: bool
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
            async for response in behaviour(requests if takes_malformed else checked(), context):
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
    return [(number, value) for number, value in _fields(data) if isinstance(value, bytes)]


def _varint_fields(data: bytes, wanted: int) -> list[int]:
    """The values of field ``wanted`` where it is a varint; stops at malformed input."""
    return [value for number, value in _fields(data) if number == wanted and isinstance(value, int)]


def _fields(data: bytes) -> list[tuple[int, int | bytes]]:
    """(field number, value) of every varint field (its number) and length-delimited field
    (its payload); skips fixed-width ones; stops at malformed input."""
    out: list[tuple[int, int | bytes]] = []
    pos = 0
    try:
        while pos < len(data):
            key, pos = _varint(data, pos)
            number, wire_type = key >> 3, key & 7
            if wire_type == 0:
                value, pos = _varint(data, pos)
                out.append((number, value))
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

"""Maps core errors to rich gRPC statuses (google.rpc BadRequest / RetryInfo) and back."""

from __future__ import annotations

import logging
from typing import Any, NoReturn

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.protobuf.message import DecodeError
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from llmmesh.runtime.errors import (
    AlreadyExists,
    FieldError,
    InvalidArgument,
    MeshError,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unavailable,
)

log = logging.getLogger(__name__)


# An error's message travels in a trailer, and gRPC drops a call whose trailers pass 8 KB
# (the client then sees RESOURCE_EXHAUSTED, not the error): a message that quotes what
# the client sent is cut to this, in the message and in its details alike.
MAX_MESSAGE_CHARS = 512


def clip(text: str) -> str:
    if len(text) <= MAX_MESSAGE_CHARS:
        return text
    return text[: MAX_MESSAGE_CHARS - 12] + "... (cut)"


def to_status(err: MeshError) -> status_pb2.Status:
    """The google.rpc.Status for a core error, with machine-readable details."""
    status = status_pb2.Status(code=code_pb2.Code.Value(err.code), message=clip(err.message))
    detail = _detail(err)
    if detail is not None:
        packed = any_pb2.Any()
        packed.Pack(detail)
        status.details.append(packed)
    return status


def _detail(err: MeshError) -> error_details_pb2.BadRequest | error_details_pb2.RetryInfo | None:
    if isinstance(err, FieldError):
        violation = error_details_pb2.BadRequest.FieldViolation(
            field=clip(err.field), description=clip(err.reason)
        )
        return error_details_pb2.BadRequest(field_violations=[violation])
    if isinstance(err, ResourceExhausted):
        delay = duration_pb2.Duration()
        delay.FromMilliseconds(int(err.retry_after_s * 1000))
        return error_details_pb2.RetryInfo(retry_delay=delay)
    return None


async def abort(context: grpc.aio.ServicerContext[Any, Any], err: MeshError) -> NoReturn:
    """Ends the RPC with the status for ``err``."""
    await context.abort_with_status(rpc_status.to_status(to_status(err)))
    raise AssertionError("abort_with_status returned")  # pragma: no cover


_FIELD_ERRORS: dict[grpc.StatusCode, type[FieldError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.ALREADY_EXISTS: AlreadyExists,
}
_FROM_CODE: dict[grpc.StatusCode, type[MeshError]] = {
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.NOT_FOUND: NotFound,
}


def from_rpc_error(err: grpc.aio.AioRpcError, upstream: str, where: str = "") -> MeshError:
    """Turns an upstream's error into a core error, keeping its code where it is
    meaningful. A caller's own mistake keeps the upstream's message (the mesh's services
    name the field); for a failure the message says which upstream failed and no more:
    the transport's details (addresses, ports) and ``where`` (the upstream's address) go
    to the log only."""
    return _from_code(err.code(), err.details() or "", _from_the_mesh(err), upstream, where)


def from_status(status: bytes, upstream: str, where: str = "") -> MeshError:
    """The core error for a serialized google.rpc.Status an upstream of the mesh sent in
    a message (a multiplexed generation's end), as from_rpc_error reads a call's."""
    try:
        parsed = status_pb2.Status.FromString(status)
        code = grpc.StatusCode[code_pb2.Code.Name(parsed.code)]
    except (DecodeError, ValueError, KeyError):
        return Unavailable(f"{upstream} sent a status that does not parse")
    return _from_code(code, parsed.message, True, upstream, where)


def _from_code(
    code: grpc.StatusCode, message: str, from_mesh: bool, upstream: str, where: str
) -> MeshError:
    named = _FIELD_ERRORS.get(code)
    if named is not None:
        field, _, reason = message.partition(": ")
        return named(field, reason) if reason else named("request", message)
    kind = _FROM_CODE.get(code)
    if kind is not None:
        return kind(message)
    log.warning(
        "upstream call failed",
        extra={"fields": {"upstream": upstream, "at": where, "code": code.name, "error": message}},
    )
    # The mesh's own services end a call with a rich status, and their messages never
    # name an address: theirs may go on. gRPC's and a proxy's own messages may.
    said = f": {message}" if message and from_mesh else ""
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return ResourceExhausted(f"{upstream} is over capacity{said}", retry_after_s=1.0)
    if code in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
        return Unavailable(f"{upstream} did not answer in time{said}")
    return Unavailable(f"{upstream} is unavailable{said}")


def _from_the_mesh(err: grpc.aio.AioRpcError) -> bool:
    return any(key == _DETAILS_KEY for key, _ in err.trailing_metadata() or ())


_DETAILS_KEY = "grpc-status-details-bin"

"""The mesh's own credential: internal services (context, policy, inference) answer only
callers that present it, whether or not sidecars stand in front of them.

The launcher writes a random token to a file only its user can read and names the file in
every service's config (``internal_token_file``); servers check it on every call, clients
send it as the ``x-mesh-token`` metadata. Health checks and reflection stay open: probes
must reach them and they reveal nothing a caller could use (the protos are public).
"""

from __future__ import annotations

import hmac
import secrets
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health
from grpc_reflection.v1alpha import reflection

from llmmesh.runtime.config import ConfigError

INTERNAL_TOKEN = "x-mesh-token"
OPEN_SERVICES = frozenset({health.SERVICE_NAME, reflection.SERVICE_NAME})
_REFUSAL = "this service answers only the mesh: the call lacks a valid x-mesh-token"


def new_token_file(path: Path) -> str:
    """A fresh token in ``path`` (mode 0600, replacing any earlier one)."""
    token = secrets.token_urlsafe(32)
    path.unlink(missing_ok=True)
    path.touch(mode=0o600)
    path.write_text(token + "\n")
    return token


def read_token(path: str | Path) -> str:
    """The token in ``path`` (the config's ``internal_token_file``); empty when none is
    configured. ConfigError when the file is missing or empty."""
    if not path:
        return ""
    try:
        token = Path(path).read_text().strip()
    except OSError as exc:
        raise ConfigError(f"internal_token_file: cannot read {path}: {exc.strerror}") from None
    if not token:
        raise ConfigError(f"internal_token_file: {path} is empty")
    return token


def token_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """The metadata that presents ``token`` (none without one)."""
    return ((INTERNAL_TOKEN, token),) if token else ()


def _service_of(method: str) -> str:
    # "/package.Service/Method" -> "package.Service"
    return method.split("/")[1] if method.count("/") >= 2 else ""


def _presented(metadata: Iterable[tuple[str, Any]] | None) -> bytes:
    for key, value in metadata or ():
        if key == INTERNAL_TOKEN:
            return value.encode() if isinstance(value, str) else bytes(value)
    return b""


def _refuse(handler: Any) -> Any:
    """A handler of the same shape as ``handler`` that refuses the call."""

    async def unary(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, _REFUSAL)

    async def streaming(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        await unary(request, context)  # raises: abort ends the call
        yield None

    deserialize, serialize = handler.request_deserializer, handler.response_serializer
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(streaming, deserialize, serialize)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(unary, deserialize, serialize)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(streaming, deserialize, serialize)
    return grpc.unary_unary_rpc_method_handler(unary, deserialize, serialize)


class RequireToken(grpc.aio.ServerInterceptor):
    """Refuses, UNAUTHENTICATED, every call but health and reflection that does not
    present the token (compared in constant time)."""

    def __init__(self, token: str) -> None:
        self._token = token.encode()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
        details: grpc.HandlerCallDetails,
    ) -> Any:
        handler = await continuation(details)
        if handler is None or _service_of(details.method) in OPEN_SERVICES:
            return handler
        if hmac.compare_digest(_presented(details.invocation_metadata), self._token):
            return handler
        return _refuse(handler)

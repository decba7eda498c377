"""Every error the router's HTTP front sends is OpenAI's error JSON, and says what the
client needs and nothing more.

aiohttp answers requests it cannot parse (a header over its size limit, a malformed
request line) itself, with a body and a log line that quote what it could not parse: an
oversized ``Authorization`` header came back to the client, and went to the log, with the
API key in it. The server here answers those with a fixed reason per kind of error.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage, BadHttpMethod, LineTooLong
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest
from prometheus_client import Counter

from llmmesh.runtime.errors import (
    FieldError,
    MeshError,
    PolicyDenied,
    ResourceExhausted,
)
from llmmesh.runtime.grpc_status import clip

if TYPE_CHECKING:
    from services.router.config import HttpSettings

log = logging.getLogger(__name__)

INTERNAL = (500, "internal_error")


def status_of(err: MeshError) -> tuple[int, str]:
    """The HTTP status and OpenAI error type of a core error."""
    return err.http_status, err.http_type


def error_body(
    message: str, kind: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(err: MeshError, names: Mapping[str, str] | None = None) -> web.Response:
    """``err`` as OpenAI's error JSON; ``names``: the request body's own names for the
    core's fields (its ``param`` and message name the field as the client sent it)."""
    if names and isinstance(err, FieldError | PolicyDenied):
        err = err.named(names)
    status, kind = status_of(err)
    param = err.field if isinstance(err, FieldError | PolicyDenied) else None
    headers = {}
    if isinstance(err, ResourceExhausted):
        headers["Retry-After"] = str(max(1, math.ceil(err.retry_after_s)))
        # The OpenAI SDKs wait this long, to the millisecond, before they try again.
        headers["retry-after-ms"] = str(max(1, math.ceil(err.retry_after_s * 1000)))
        headers.update(err.rate_limits)
    body = error_body(clip(err.message), kind, param and clip(param), err.http_code)
    return web.json_response(body, status=status, headers=headers)


@web.middleware
async def http_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """aiohttp's own refusals (no such route, wrong method, body too large) as OpenAI
    error JSON too."""
    try:
        response: web.StreamResponse = await handler(request)
        return response
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        kind = "not_found_error" if exc.status == 404 else "invalid_request_error"
        headers = {}
        if isinstance(exc, web.HTTPMethodNotAllowed):
            headers["Allow"] = exc.headers["Allow"]
        return web.json_response(
            error_body(_refusal(exc), kind), status=exc.status, headers=headers
        )


def _refusal(exc: web.HTTPException) -> str:
    """What the client did wrong, without quoting the request (its path may hold a key)."""
    if isinstance(exc, web.HTTPNotFound):
        return "no such endpoint (GET /openapi.json lists them)"
    if isinstance(exc, web.HTTPMethodNotAllowed):
        allowed = ", ".join(sorted(exc.allowed_methods))
        return f"method not allowed on this endpoint; it takes {allowed}"
    if isinstance(exc, web.HTTPRequestEntityTooLarge):  # aiohttp's text: the two sizes
        return f"request body too large: {exc.text}"
    return exc.reason


def _reason(exc: BaseException | None, status: int) -> str:
    if isinstance(exc, LineTooLong):
        return "a request header or the request line is too long"
    if isinstance(exc, BadHttpMethod):
        return "unknown HTTP method"
    if isinstance(exc, BadHttpMessage):
        return "malformed HTTP request"
    return "internal error" if status >= 500 else "bad request"


class _Handler(RequestHandler):
    """A connection whose error responses carry a fixed reason, never the request; that
    must send its first request's headers within the header timeout; and that is refused
    (429, then closed) when its client address holds too many connections already."""

    _peer: str | None = None
    _header_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        server = self._manager
        assert isinstance(server, _Server)
        peer = transport.get_extra_info("peername")
        address = str(peer[0]) if isinstance(peer, tuple) else ""
        if server.clients[address] >= server.settings.max_connections_per_client:
            TOO_MANY_CONNECTIONS.inc()
            transport.write(_TOO_MANY)  # type: ignore[attr-defined]
            transport.close()
            return
        server.clients[address] += 1
        self._peer = address
        super().connection_made(transport)
        self._header_deadline = self._loop.call_later(
            server.settings.header_timeout_s, self._headers_overdue
        )

    def _headers_overdue(self) -> None:
        if self._request_count == 0:  # not one whole request line and headers yet
            HEADER_TIMEOUTS.inc()
            self.force_close()
            if self.transport is not None:
                self.transport.close()

    def connection_lost(self, exc: BaseException | None) -> None:
        server = self._manager
        if self._header_deadline is not None:
            self._header_deadline.cancel()
        if isinstance(server, _Server) and self._peer is not None:
            server.clients[self._peer] -= 1
            if server.clients[self._peer] <= 0:
                del server.clients[self._peer]
            self._peer = None
        super().connection_lost(exc)

    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if status >= 500:
            log.error("HTTP request failed", exc_info=exc)
        else:  # the exception's text quotes the request: its kind only
            log.info("HTTP request refused", extra={"fields": {"error": type(exc).__name__}})
        if request.writer.output_size > 0:
            raise ConnectionError("the response has started: no error response can follow")
        kind = INTERNAL[1] if status >= 500 else "invalid_request_error"
        response = web.json_response(error_body(_reason(exc, status), kind), status=status)
        response.force_close()
        return response


class _Server(web.Server):
    settings: HttpSettings
    clients: collections.Counter[str]

    def __call__(self) -> RequestHandler:
        return _Handler(self, loop=self._loop, **self._kwargs)


class HttpRunner(web.AppRunner):
    """aiohttp's application runner, its connections answering errors and keeping the
    limits of ``settings`` as above."""

    def __init__(self, app: web.Application, settings: HttpSettings, **kwargs: Any) -> None:
        super().__init__(app, keepalive_timeout=settings.idle_timeout_s, **kwargs)
        self._settings = settings

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _Server  # the same server; only its connections' class differs
        assert isinstance(server, _Server)
        server.settings = self._settings
        server.clients = collections.Counter()
        return server


def _raw_error(status: int, reason: str, message: str, kind: str) -> bytes:
    """A whole HTTP/1.1 error response, for a connection refused before it has a
    request to answer."""
    body = json.dumps(error_body(message, kind)).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body


_TOO_MANY = _raw_error(
    429, "Too Many Requests", "too many open connections from this address", "rate_limit_error"
)
TOO_MANY_CONNECTIONS = Counter(
    "llm_router_http_connections_refused_total",
    "HTTP connections refused: their client address held too many already",
)
HEADER_TIMEOUTS = Counter(
    "llm_router_http_header_timeouts_total",
    "HTTP connections closed for not sending a request's headers in time",
)

"""Every error the router's HTTP front sends is OpenAI's error JSON, and says what the
client needs and nothing more.

aiohttp answers requests it cannot parse (a header over its size limit, a malformed
request line) itself, with a body and a log line that quote what it could not parse: an
oversized ``Authorization`` header came back to the client, and went to the log, with the
API key in it. The server here answers those with a fixed reason per kind of error.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage, BadHttpMethod, LineTooLong
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from llmmesh.runtime.errors import (
    FieldError,
    MeshError,
    ResourceExhausted,
)

log = logging.getLogger(__name__)

INTERNAL = (500, "internal_error")


def status_of(err: MeshError) -> tuple[int, str]:
    """The HTTP status and OpenAI error type of a core error."""
    return err.http_status, err.http_type


def error_body(message: str, kind: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


def error_response(err: MeshError) -> web.Response:
    status, kind = status_of(err)
    param = err.field if isinstance(err, FieldError) else None
    headers = {}
    if isinstance(err, ResourceExhausted):
        headers["Retry-After"] = str(max(1, math.ceil(err.retry_after_s)))
    return web.json_response(error_body(err.message, kind, param), status=status, headers=headers)


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
        return web.json_response(error_body(exc.reason, kind), status=exc.status)


def _reason(exc: BaseException | None, status: int) -> str:
    if isinstance(exc, LineTooLong):
        return "a request header or the request line is too long"
    if isinstance(exc, BadHttpMethod):
        return "unknown HTTP method"
    if isinstance(exc, BadHttpMessage):
        return "malformed HTTP request"
    return "internal error" if status >= 500 else "bad request"


class _Handler(RequestHandler):
    """A connection whose error responses carry a fixed reason, never the request."""

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
    def __call__(self) -> RequestHandler:
        return _Handler(self, loop=self._loop, **self._kwargs)


class HttpRunner(web.AppRunner):
    """aiohttp's application runner, its connections answering errors as above."""

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _Server  # the same server; only its connections' class differs
        return server

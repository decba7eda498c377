"""The router's HTTP front never quotes a request it refuses: not in the body, not in
the log (an oversized Authorization header carries an API key)."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest
from aiohttp import web

from services.router.http_errors import HttpRunner, http_errors

SECRET = "sk-" + "s3cr3t" * 2000  # over aiohttp's 8190-byte header limit


async def _ok(request: web.Request) -> web.Response:
    return web.json_response({"ok": True})


async def _exchange(raw: bytes) -> tuple[int, bytes]:
    app = web.Application(middlewares=[http_errors])
    app.router.add_get("/", _ok)
    runner = HttpRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(raw)
        await writer.drain()
        reply = await asyncio.wait_for(reader.read(), 10)
        writer.close()
    finally:
        await runner.cleanup()
    head, _, body = reply.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


@pytest.mark.parametrize(
    "raw",
    [
        f"GET / HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {SECRET}\r\n\r\n".encode(),
        f"GET /{SECRET} HTTP/1.1\r\nHost: x\r\n\r\n".encode(),
        f"GET / HTTP/1.1\r\nHost: x\r\nBad Header {SECRET[:40]}\r\n\r\n".encode(),
    ],
    ids=["long-header", "long-request-line", "malformed-header"],
)
def test_refused_requests_are_not_quoted(raw: bytes, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    status, body = asyncio.run(_exchange(raw))
    assert status == 400
    assert json.loads(body)["error"]["type"] == "invalid_request_error"
    assert b"s3cr3t" not in body
    assert "s3cr3t" not in caplog.text


def test_a_good_request_is_served() -> None:
    status, body = asyncio.run(_exchange(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"))
    assert (status, json.loads(body)) == (200, {"ok": True})

"""The router's HTTP front never quotes a request it refuses: not in the body, not in
the log (an oversized Authorization header carries an API key); and it keeps its
connection limits: a header timeout, an idle timeout, connections per client address."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from services.router.config import HttpSettings
from services.router.http_errors import HttpRunner, http_errors

SECRET = "sk-" + "s3cr3t" * 2000  # over aiohttp's 8190-byte header limit


async def _ok(request: web.Request) -> web.Response:
    return web.json_response({"ok": True})


@contextlib.asynccontextmanager
async def serving(settings: HttpSettings | None = None) -> AsyncIterator[int]:
    """The HTTP front's server on a free port, with ``_ok`` at ``/``."""
    app = web.Application(middlewares=[http_errors])
    app.router.add_get("/", _ok)
    runner = HttpRunner(app, settings or HttpSettings(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield runner.addresses[0][1]
    finally:
        await runner.cleanup()


def _parsed(reply: bytes) -> tuple[int, bytes]:
    head, _, body = reply.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


async def _reply(raw: bytes) -> bytes:
    async with serving() as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(raw)
        await writer.drain()
        reply = await asyncio.wait_for(reader.read(), 10)
        writer.close()
    return reply


async def _exchange(raw: bytes) -> tuple[int, bytes]:
    return _parsed(await _reply(raw))


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


def test_an_unknown_endpoint_is_named_as_such_without_quoting_it() -> None:
    raw = f"POST /v1/{SECRET[:40]} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    status, body = asyncio.run(_exchange(raw.encode()))
    error = json.loads(body)["error"]
    assert (status, error["type"]) == (404, "not_found_error")
    assert "no such endpoint" in error["message"]
    assert b"s3cr3t" not in body


def test_a_wrong_method_names_the_ones_the_endpoint_takes() -> None:
    raw = b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    head, _, body = asyncio.run(_reply(raw)).partition(b"\r\n\r\n")
    assert int(head.split()[1]) == 405
    assert b"\r\nAllow: GET,HEAD" in head
    assert json.loads(body)["error"]["message"].endswith("it takes GET, HEAD")


def test_a_body_over_the_limit_is_refused_with_the_limit() -> None:
    async def scenario() -> tuple[int, dict[str, str]]:
        async def read(request: web.Request) -> web.Response:
            await request.read()
            return web.json_response({})

        app = web.Application(client_max_size=1024, middlewares=[http_errors])
        app.router.add_post("/", read)
        async with TestClient(TestServer(app)) as client:
            response = await client.post("/", data=b"x" * 4096)
            return response.status, (await response.json())["error"]

    status, error = asyncio.run(scenario())
    assert status == 413 and error["message"].startswith("request body too large: ")
    assert "1024" in error["message"]


def test_a_connection_that_never_finishes_its_headers_is_closed() -> None:
    """Half a request's headers, then silence: closed at the header timeout, not held."""

    async def scenario() -> tuple[bytes, float]:
        async with serving(HttpSettings(header_timeout_s=0.3, idle_timeout_s=30)) as port:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
            started = time.monotonic()
            eof = await asyncio.wait_for(reader.read(), 10)  # returns when it is closed
            writer.close()
            return eof, time.monotonic() - started

    eof, waited = asyncio.run(scenario())
    assert eof == b"" and waited < 5


def test_an_idle_keep_alive_connection_is_closed() -> None:
    async def scenario() -> tuple[int, bytes]:
        async with serving(HttpSettings(idle_timeout_s=0.3)) as port:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            rest = await asyncio.wait_for(reader.read(), 10)  # the reply, then the close
            writer.close()
            return _parsed(rest)[0], rest

    status, rest = asyncio.run(scenario())
    assert status == 200 and rest.endswith(b'{"ok": true}')


def test_one_address_holds_at_most_its_share_of_connections() -> None:
    async def scenario() -> tuple[int, str, int]:
        async with serving(HttpSettings(max_connections_per_client=2)) as port:
            held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]
            for _, writer in held:  # each served, so each is counted before the next
                writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            for reader, _ in held:
                await asyncio.wait_for(reader.readuntil(b'{"ok": true}'), 10)
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            refused, body = _parsed(await asyncio.wait_for(reader.read(), 10))
            writer.close()
            # The server closes the first one (its EOF here comes after the server let go).
            first_reader, first = held[0]
            first.write(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            await asyncio.wait_for(first_reader.read(), 10)
            first.close()
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            served, _ = _parsed(await asyncio.wait_for(reader.read(), 10))
            writer.close()
            for _, writer in held[1:]:
                writer.close()
            return refused, json.loads(body)["error"]["type"], served

    assert asyncio.run(scenario()) == (429, "rate_limit_error", 200)

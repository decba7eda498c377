"""Reading Triton's metrics page: one kept-alive connection, and every failure an OSError
(the load monitor takes that as the engine unreachable)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest
from aiohttp import web

from services.inference.metrics_page import MetricsPage

PAGE = 'llm_engine_running_sequences{model="llm"} 3\n' * 2000  # larger than one read


@asynccontextmanager
async def serving(
    handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
) -> AsyncIterator[str]:
    app = web.Application()
    app.router.add_get("/metrics", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}/metrics"
    finally:
        await runner.cleanup()


async def reads(
    handler: Callable[[web.Request], Awaitable[web.StreamResponse]], times: int
) -> list[str]:
    """The page read ``times`` times from a server answering with ``handler``."""
    async with serving(handler) as url:
        page = MetricsPage(url)
        try:
            return [await page.read() for _ in range(times)]
        finally:
            await page.close()


def test_reads_the_page_again_and_again_over_one_connection() -> None:
    connections: set[int] = set()

    async def handler(request: web.Request) -> web.Response:
        connections.add(id(request.transport))
        return web.Response(text=PAGE)

    assert asyncio.run(reads(handler, 3)) == [PAGE] * 3
    assert len(connections) == 1


def test_reads_at_once_take_turns_on_the_one_connection() -> None:
    """A watch that starts reads the page while the poller may be reading it."""

    async def handler(request: web.Request) -> web.Response:
        return web.Response(text=PAGE)

    async def scenario() -> list[str]:
        async with serving(handler) as url:
            page = MetricsPage(url)
            try:
                first = await page.read()  # the connection, open and kept
                return [first, *await asyncio.gather(*(page.read() for _ in range(4)))]
            finally:
                await page.close()

    assert asyncio.run(scenario()) == [PAGE] * 5


def test_a_server_that_closes_after_each_reply_is_connected_to_again() -> None:
    connections: set[int] = set()

    async def handler(request: web.Request) -> web.Response:
        connections.add(id(request.transport))
        return web.Response(text="page", headers={"Connection": "close"})

    assert asyncio.run(reads(handler, 2)) == ["page", "page"]
    assert len(connections) == 2


def test_an_error_status_is_an_os_error_and_the_next_read_succeeds() -> None:
    statuses = iter([503, 200])

    async def handler(request: web.Request) -> web.Response:
        return web.Response(status=next(statuses), text="page")

    async def run() -> str:
        async with serving(handler) as url:
            page = MetricsPage(url)
            try:
                with pytest.raises(OSError, match="status 503"):
                    await page.read()
                return await page.read()
            finally:
                await page.close()

    assert asyncio.run(run()) == "page"


def test_an_unreachable_server_is_an_os_error() -> None:
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]  # closed again: nothing listens there
    page = MetricsPage(f"http://127.0.0.1:{port}/metrics")
    with pytest.raises(OSError, match=str(port)):
        asyncio.run(page.read())


def test_a_server_that_never_answers_is_an_os_error_after_the_timeout() -> None:
    async def run() -> None:
        accepted = asyncio.Event()

        async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            accepted.set()
            await reader.read()  # reads the request, never answers

        server = await asyncio.start_server(silent, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        page = MetricsPage(f"http://127.0.0.1:{port}/metrics", timeout_s=0.2)
        try:
            with pytest.raises(OSError, match="TimeoutError"):
                await page.read()
            assert accepted.is_set()
        finally:
            server.close()

    asyncio.run(run())


def test_a_url_that_is_not_plain_http_is_refused() -> None:
    with pytest.raises(ValueError, match="metrics URL"):
        MetricsPage("https://127.0.0.1:8002/metrics")

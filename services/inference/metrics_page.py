"""Triton's metrics page, read over one kept-alive HTTP/1.1 connection.

The load monitor reads it 20 times a second while there is work, and on a host whose CPU
the engine shares every read counts: httptools (llhttp's C parser, as uvicorn uses it)
over asyncio streams takes about half the CPU per read of aiohttp's client, whose cookie
jar, tracing hooks and connector run for every request (docs/benchmarks.md, "Baseline").
A reply must say its length (Triton's does, or is chunked): one that ends only with the
connection's close is taken as a broken reply.
"""

from __future__ import annotations

import asyncio
from urllib.parse import urlsplit

import httptools

READ_SIZE = 65536


class _Reply:
    """httptools' callbacks for one response: its status, body, whether the connection
    stays open after it (known once its headers are), and whether it is complete."""

    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.status = 0
        self.keep_alive = False
        self.body = bytearray()
        self.complete = False

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.keep_alive = self.parser.should_keep_alive()

    def on_body(self, data: bytes) -> None:
        self.body += data

    def on_message_complete(self) -> None:
        self.complete = True


class MetricsPage:
    """GET of one URL, again and again, on the same connection while the server keeps it."""

    def __init__(self, url: str, timeout_s: float = 1.0) -> None:
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"metrics URL: http://host:port/path, got {url!r}")
        self._url = url
        self._host, self._port = parts.hostname, parts.port or 80
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        self._request = (
            f"GET {target} HTTP/1.1\r\nHost: {parts.netloc}\r\nAccept-Encoding: identity\r\n\r\n"
        ).encode("ascii")
        self._timeout_s = timeout_s
        self._stream: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        # One request at a time on the one connection: a watch that starts reads the page
        # while the poller may be reading it, and two readers of one stream collide.
        self._turn = asyncio.Lock()

    async def read(self) -> str:
        """The page's text; OSError when it cannot be had (unreachable, an error status,
        a broken reply, no reply within the timeout)."""
        try:
            async with self._turn, asyncio.timeout(self._timeout_s):
                return await self._get()
        except (OSError, httptools.HttpParserError, TimeoutError) as err:
            await self.close()  # a connection left mid-reply cannot carry the next
            raise OSError(f"{self._url}: {str(err) or type(err).__name__}") from err

    async def close(self) -> None:
        stream, self._stream = self._stream, None
        if stream is not None:
            stream[1].close()

    async def _get(self) -> str:
        if self._stream is None:
            self._stream = await asyncio.open_connection(self._host, self._port)
        reader, writer = self._stream
        writer.write(self._request)
        reply = _Reply()
        while not reply.complete:
            data = await reader.read(READ_SIZE)
            if not data:
                raise ConnectionResetError("the server closed the connection")
            reply.parser.feed_data(data)
        if not reply.keep_alive:
            await self.close()  # the server closes after this reply
        if reply.status != 200:
            raise ConnectionError(f"status {reply.status}")
        return reply.body.decode()

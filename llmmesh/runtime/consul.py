"""Consul through py-consul: blocking queries (``index`` / ``wait``, following
``X-Consul-Index``) and KV watches built on them.

The query loop follows Consul's documented rules for blocking queries: reset the index
when it goes backwards, never query with an index below 1, and pace retries after errors.
When Consul is unreachable the last values stay in force.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any, TypeVar
from urllib.parse import urlsplit

import aiohttp
import consul
import consul.aio
from prometheus_client import Counter

log = logging.getLogger(__name__)

T = TypeVar("T")

CONSUL_ERRORS = Counter(
    "llm_consul_errors_total", "Consul queries that failed, by what was queried", ["query"]
)
RETRY_DELAY_S = (0.2, 5.0)  # first and longest pause after a failed query
MIN_QUERY_INTERVAL_S = 0.05  # rate limit: a misbehaving server cannot make us spin


def location(address: str) -> tuple[str, int, str]:
    """(host, port, scheme) of ``host:port`` or ``scheme://host:port``."""
    parts = urlsplit(address if "//" in address else f"//{address}")
    return parts.hostname or "127.0.0.1", parts.port or 8500, parts.scheme or "http"


def connect(address: str = "", token: str = "") -> consul.aio.Consul:
    """An async client for ``host:port`` or ``scheme://host:port``; empty uses
    ``CONSUL_HTTP_ADDR`` or the local agent."""
    if not address:
        return consul.aio.Consul(token=token or None)
    host, port, scheme = location(address)
    return consul.aio.Consul(host=host, port=port, scheme=scheme, token=token or None)


async def blocking_query(
    fetch: Callable[[int], Awaitable[tuple[Any, T]]], what: str
) -> AsyncGenerator[T, None]:
    """Yields the result of ``fetch(index)`` now and after every index change."""
    index, failures = 0, 0
    loop = asyncio.get_running_loop()
    while True:
        started = loop.time()
        try:
            raw_index, value = await fetch(index)
        except (consul.ConsulException, aiohttp.ClientError, TimeoutError, OSError) as err:
            failures += 1
            CONSUL_ERRORS.labels(what).inc()
            delay = min(RETRY_DELAY_S[1], RETRY_DELAY_S[0] * 2 ** (failures - 1))
            log.warning(
                "consul query failed; keeping the last value",
                extra={"fields": {"query": what, "error": repr(err), "retry_in_s": delay}},
            )
            await asyncio.sleep(random.uniform(delay / 2, delay))  # jittered backoff
            continue
        failures = 0
        new_index = _as_index(raw_index)
        changed = new_index != index
        # Backwards (e.g. a server restored from a snapshot): start over with a full read.
        # Otherwise never below 1, or every query would return at once.
        index = 0 if new_index < index else max(new_index, 1)
        if changed:
            yield value
        pause = MIN_QUERY_INTERVAL_S - (loop.time() - started)
        if pause > 0:
            await asyncio.sleep(pause)  # rate limit


def _as_index(raw: Any) -> int:
    try:
        return max(int(raw), 0)
    except (TypeError, ValueError):
        return 0


class ConsulKeyWatch:
    """The value of one KV key now and after every change (absent keys are skipped)."""

    def __init__(self, client: consul.aio.Consul, key: str, wait: str = "30s") -> None:
        self._client = client
        self._key = key
        self._wait = wait

    async def watch(self) -> AsyncGenerator[bytes, None]:
        async def fetch(index: int) -> tuple[Any, Any]:
            result: tuple[Any, Any] = await self._client.kv.get(
                self._key, index=index or None, wait=self._wait
            )
            return result

        async for entry in blocking_query(fetch, f"kv/{self._key}"):
            if entry is None:
                log.warning("consul key %s is absent; the last value stays", self._key)
                continue
            yield entry.get("Value") or b""


class ConsulPrefixWatch:
    """Every key under a prefix, as {rest of the key: text}, now and after every change."""

    def __init__(self, client: consul.aio.Consul, prefix: str, wait: str = "30s") -> None:
        self._client = client
        self._prefix = prefix
        self._wait = wait

    async def watch(self) -> AsyncGenerator[dict[str, str], None]:
        async def fetch(index: int) -> tuple[Any, Any]:
            result: tuple[Any, Any] = await self._client.kv.get(
                self._prefix, index=index or None, wait=self._wait, recurse=True
            )
            return result

        async for entries in blocking_query(fetch, f"kv/{self._prefix}"):
            values = {}
            for entry in entries or []:
                name = str(entry.get("Key", ""))[len(self._prefix) :]
                try:
                    values[name] = (entry.get("Value") or b"").decode("utf-8")
                except UnicodeDecodeError:
                    log.warning("consul key %s is not UTF-8; skipped", entry.get("Key"))
            yield {name: text for name, text in values.items() if name and "/" not in name}

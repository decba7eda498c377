"""The routers of a fleet, as Redis sees them: each beats every ``interval_s`` into one
sorted set (scored by Redis's clock), and a router whose last beat is older than
``ttl_s`` is gone. Each router learns N, the routers alive, from its own beat: admission
gives each router 1/N of the fleet's window, and the budgets' fallback 1/N of each limit.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import redis.asyncio as redis
from prometheus_client import Gauge

from services.router.shared.resilient import REDIS_ERRORS, SharedHealth

log = logging.getLogger(__name__)

ROUTERS = Gauge("llm_router_fleet_routers", "Routers alive, as this router's last heartbeat saw")

# KEYS: the heartbeats. ARGV: this router, the TTL in ms. Returns the routers alive.
_BEAT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZADD', KEYS[1], now, ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - tonumber(ARGV[2]))
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[2]) * 10)
return redis.call('ZCARD', KEYS[1])
"""


class Fleet:
    def __init__(
        self,
        client: redis.Redis,
        key: str,
        router_id: str,
        health: SharedHealth,
        *,
        interval_s: float = 1.0,
        ttl_s: float = 3.0,
        on_size: Callable[[int], None] = lambda _: None,
    ) -> None:
        self._client = client
        self._key = key
        self.router_id = router_id
        self._health = health
        self._interval = interval_s
        self._ttl_ms = int(ttl_s * 1000)
        self._on_size = on_size
        self._beat: Any = client.register_script(_BEAT)
        self.size = 1  # until the first beat: alone

    async def beat(self) -> None:
        """One heartbeat: Redis's answer updates N, its silence marks shared state out."""
        try:
            async with asyncio.timeout(self._interval):
                size = int(await self._beat(keys=[self._key], args=[self.router_id, self._ttl_ms]))
        except REDIS_ERRORS as err:
            self._health.down(err)
            return
        self._health.back()
        if size != self.size:
            log.info("fleet", extra={"fields": {"routers": size, "was": self.size}})
            self.size = size
            self._on_size(size)
        ROUTERS.set(size)

    async def run(self) -> None:
        while True:
            await self.beat()
            await asyncio.sleep(self._interval)  # the heartbeat period

    async def leave(self) -> None:
        """Gone at once for the others (a clean stop), rather than after the TTL."""
        try:
            async with asyncio.timeout(self._interval):
                await self._client.zrem(self._key, self.router_id)
        except REDIS_ERRORS:
            pass

"""The router's shared state, built by name: ``memory`` or ``redis``."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field

import redis.asyncio as redis

from services.router.scheduling import SchedulingState
from services.router.shared.allowances import AllowanceBudgets
from services.router.shared.budgets import MemoryBudgets
from services.router.shared.fleet import Fleet
from services.router.shared.redis_budgets import RedisBudgets
from services.router.shared.resilient import REDIS_ERRORS, SharedBudgets, SharedHealth
from services.router.shared.settings import SharedSettings
from services.router.shared.sync import PeerStreams, SchedulingSync

FleetSizeListener = Callable[[int], None]


def new_router_id() -> str:
    """Unique per router process, readable in Redis: host, pid and a random tail."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


@dataclass
class SharedState:
    budgets: SharedBudgets
    router_id: str
    fleet: Fleet | None = None
    client: redis.Redis | None = None
    health: SharedHealth = field(default_factory=SharedHealth)
    # The other routers' streams per replica (None: one router, there are none).
    peers: PeerStreams | None = None
    sync: SchedulingSync | None = None
    warm: Callable[[], Awaitable[None]] | None = None  # readies shared state before traffic
    allowances: AllowanceBudgets | None = None  # budgets spent locally, given back when idle
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)

    def fleet_size(self) -> int:
        return self.fleet.size if self.fleet is not None else 1

    def share_scheduling(
        self, state: SchedulingState, in_flight: Callable[[], Mapping[str, int]]
    ) -> None:
        """Publishes this router's picks and in-flight counts (read from ``in_flight``),
        and applies the other routers' to ``state``."""
        if self.sync is not None:
            state.on_pick = self.sync.picked
            self.sync.attach(state, in_flight)

    async def session_home(self, key: str) -> None:
        """Learns where a session lives if another router placed it."""
        if self.sync is not None:
            await self.sync.session_home(key)

    async def start(self) -> None:
        if self.warm is not None:
            try:
                await self.warm()
            except REDIS_ERRORS as err:  # the heartbeat will find Redis when it is back
                self.health.down(err)
        if self.fleet is not None:
            await self.fleet.beat()  # N known before the first request
            self._tasks.append(asyncio.create_task(self.fleet.run()))
        if self.sync is not None:
            self._tasks.append(asyncio.create_task(self.sync.run()))
        if self.allowances is not None:
            self._tasks.append(asyncio.create_task(self.allowances.run()))

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.allowances is not None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(1.0):
                    await self.allowances.close()
        if self.fleet is not None:
            await self.fleet.leave()
        if self.client is not None:
            with contextlib.suppress(Exception):
                await self.client.aclose()


def memory_state(
    redis_url: str, settings: SharedSettings, on_size: FleetSizeListener
) -> SharedState:
    """One router: everything in this process."""
    return SharedState(SharedBudgets.local(), new_router_id())


def redis_state(
    redis_url: str, settings: SharedSettings, on_size: FleetSizeListener
) -> SharedState:
    """Any number of routers over one Redis, each falling back to its share of every
    limit while Redis is out of reach."""
    router_id, health = new_router_id(), SharedHealth()
    client = redis.Redis.from_url(
        redis_url, socket_timeout=settings.timeout_s, socket_connect_timeout=settings.timeout_s
    )
    prefix = settings.key_prefix
    fleet = Fleet(
        client,
        f"{prefix}routers",
        router_id,
        health,
        interval_s=settings.heartbeat_interval_s,
        ttl_s=settings.heartbeat_ttl_s,
        on_size=on_size,
    )
    shared = RedisBudgets(client, prefix, router_id, settings.heartbeat_ttl_s)
    allowances = (
        AllowanceBudgets(shared, settings.allowance_s, settings.allowance_idle_s)
        if settings.allowance_s > 0
        else None
    )
    budgets = SharedBudgets(
        MemoryBudgets(),
        allowances or shared,
        health,
        lambda: fleet.size,
        charge_interval_s=settings.charge_interval_s,
        timeout_s=settings.timeout_s,
    )
    sync = SchedulingSync(
        client,
        prefix,
        router_id,
        PeerStreams(settings.heartbeat_ttl_s),
        health,
        keepalive_s=settings.heartbeat_interval_s / 4,
        timeout_s=settings.timeout_s,
    )
    return SharedState(
        budgets, router_id, fleet, client, health, sync.peers, sync, shared.warm, allowances
    )


BACKENDS: dict[str, Callable[[str, SharedSettings, FleetSizeListener], SharedState]] = {
    "memory": memory_state,
    "redis": redis_state,
}


def build_shared_state(
    kind: str, redis_url: str, settings: SharedSettings, on_size: FleetSizeListener
) -> SharedState:
    return BACKENDS[kind](redis_url, settings, on_size)

"""Scheduling state shared by the routers of a fleet: where each router sent its
requests (sessions and prompt prefixes) and the streams it has open on each replica.

Every pick is kept locally first (the pick path never waits on Redis), then published:
picks and in-flight counts go out together on one Redis channel at most every
``interval_s`` (and the counts at least every ``keepalive_s``), and every router applies
the others' to its own prefix index and session table. A session's home is also written
to a key of its own, at once rather than with the next message (the conversation's next
turn may come through another router as soon as this one ends), which a router that has
not heard of the session (it started later, or missed a message) reads before it picks.
In-flight counts of a router not heard from for ``stale_after_s`` stop counting.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import redis.asyncio as redis

from services.router.scheduling import SchedulingState
from services.router.scheduling.types import Picked
from services.router.shared.resilient import REDIS_ERRORS, SharedHealth

log = logging.getLogger(__name__)


class PeerStreams:
    """Streams the other routers have open, per replica, as they last reported them."""

    def __init__(self, stale_after_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._stale = stale_after_s
        self._clock = clock
        self._heard: dict[str, tuple[float, dict[str, int]]] = {}  # router -> (when, counts)
        self._totals: dict[str, int] = {}
        self._totalled_at = -1.0

    def heard(self, router: str, counts: Mapping[str, int]) -> None:
        self._heard[router] = (self._clock(), dict(counts))
        self._totalled_at = -1.0

    def in_flight(self, address: str) -> int:
        now = self._clock()
        if now - self._totalled_at > 0.01:  # totals at most 100 times a second
            self._total(now)
        return self._totals.get(address, 0)

    def _total(self, now: float) -> None:
        totals: dict[str, int] = {}
        for router, (when, counts) in list(self._heard.items()):
            if now - when > self._stale:
                del self._heard[router]
                continue
            for address, count in counts.items():
                totals[address] = totals.get(address, 0) + count
        self._totals, self._totalled_at = totals, now


class SchedulingSync:
    def __init__(
        self,
        client: redis.Redis,
        prefix: str,
        router_id: str,
        peers: PeerStreams,
        health: SharedHealth,
        *,
        interval_s: float = 0.05,
        keepalive_s: float = 0.25,
        session_ttl_s: int = 3600,
        timeout_s: float = 0.25,
    ) -> None:
        self._client = client
        self._channel = f"{prefix}picks"
        self._session_prefix = f"{prefix}session:"
        self._router = router_id
        self._state = SchedulingState("")  # until attach(): the scheduler's own
        self.peers = peers
        self._health = health
        self._interval = interval_s
        self._keepalive = keepalive_s
        self._session_ttl = session_ttl_s
        self._timeout = timeout_s
        self._own = f'{{"router": {json.dumps(router_id)},'.encode()  # its messages' start
        self._picks: list[Picked] = []
        self._in_flight: Callable[[], Mapping[str, int]] = dict
        self._sent_counts: dict[str, int] = {}
        self._sent_at = 0.0
        self._homes: dict[str, str] = {}  # session key -> home, to write
        self._writing: asyncio.Task[None] | None = None

    def attach(self, state: SchedulingState, in_flight: Callable[[], Mapping[str, int]]) -> None:
        """The scheduler's state, which the others' picks go into, and where this
        router's own in-flight counts are read (the replica set)."""
        self._state = state
        self._in_flight = in_flight

    def picked(self, picked: Picked) -> None:
        """This router's pick, to publish with the next message (SchedulingState.on_pick)."""
        self._picks.append(picked)
        if picked.session_key:
            self._homes[picked.session_key] = json.dumps([picked.address, picked.subset])
            if self._writing is None or self._writing.done():
                self._writing = asyncio.get_running_loop().create_task(self._write_homes())

    async def _write_homes(self) -> None:
        """Writes the sessions' homes picked since the last write, in one pipeline, until
        none is left (those picked meanwhile go in the next)."""
        while self._homes:
            homes, self._homes = self._homes, {}
            pipe = self._client.pipeline(transaction=False)
            for key, home in homes.items():
                pipe.set(self._session_prefix + key, home, ex=self._session_ttl)
            try:
                async with asyncio.timeout(self._timeout):
                    await pipe.execute()
            except REDIS_ERRORS as err:
                self._health.down(err)
                return

    async def session_home(self, key: str) -> None:
        """Learns the session's home from Redis unless this router knows it already."""
        if self._state.sessions.get(key) is not None:
            return
        try:
            async with asyncio.timeout(self._timeout):
                raw = await self._client.get(self._session_prefix + key)
        except REDIS_ERRORS as err:
            self._health.down(err)
            return
        if raw:
            address, subset = json.loads(raw)
            self._state.sessions.set(key, address, subset)

    async def run(self) -> None:
        try:
            await asyncio.gather(self._publish(), self._subscribe())
        finally:
            if self._writing is not None:
                self._writing.cancel()

    # -- out ---------------------------------------------------------------------

    async def _publish(self) -> None:
        while True:
            await asyncio.sleep(self._interval)  # the batching period
            counts = dict(self._in_flight())
            due = time.monotonic() - self._sent_at >= self._keepalive
            if not self._picks and counts == self._sent_counts and not due:
                continue
            picks, self._picks = self._picks, []
            try:
                async with asyncio.timeout(self._timeout):
                    await self._send(picks, counts)
            except REDIS_ERRORS as err:
                self._health.down(err)
                continue
            self._sent_counts, self._sent_at = counts, time.monotonic()

    async def _send(self, picks: list[Picked], counts: dict[str, int]) -> None:
        message = {  # "router" first: a router skips its own messages by their start
            "router": self._router,
            "in_flight": counts,
            "picks": [[p.address, p.subset, p.session_key, list(p.prefix)] for p in picks],
        }
        await self._client.publish(self._channel, json.dumps(message))

    # -- in ----------------------------------------------------------------------

    async def _subscribe(self) -> None:
        while True:
            try:
                await self._listen()
            except REDIS_ERRORS as err:
                self._health.down(err)
            await asyncio.sleep(1.0)  # the pace of resubscribing after Redis trouble

    async def _listen(self) -> None:
        pubsub: Any = self._client.pubsub(ignore_subscribe_messages=True)
        try:
            await pubsub.subscribe(self._channel)
            while True:
                message = await pubsub.get_message(timeout=self._keepalive * 4)
                if message is not None and not message["data"].startswith(self._own):
                    self._apply(json.loads(message["data"]))
        finally:
            with contextlib.suppress(*REDIS_ERRORS):
                await pubsub.aclose()

    def _apply(self, message: dict[str, Any]) -> None:
        router = message.get("router")
        if not router or router == self._router:
            return
        self.peers.heard(router, message.get("in_flight") or {})
        for address, subset, session_key, prefix in message.get("picks") or ():
            self._state.learn(Picked(address, subset, session_key, prefix))

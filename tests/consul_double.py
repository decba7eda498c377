"""A stand-in for a Consul agent's HTTP API, for tests only (never shipped).

No Consul binary can be had on the machines this suite runs on, so the router's Consul
adapters are tested against this server when ``CONSUL_HTTP_ADDR`` is not set. It
implements exactly the documented semantics those adapters rely on, and nothing else:

- KV: ``GET /v1/kv/<key>`` (404 when absent), ``PUT /v1/kv/<key>`` with ``?cas=``,
  ``DELETE /v1/kv/<key>``;
- blocking queries: ``?index=N&wait=D`` holds the request until the resource's index
  exceeds N or D elapses; every answer carries ``X-Consul-Index``;
- ``GET /v1/health/service/<name>?passing``, fed by ``PUT /v1/agent/service/register``
  and ``PUT /v1/agent/service/deregister/<id>`` (services without checks are passing);
- sessions: ``PUT /v1/session/create`` (``TTL``), ``/v1/session/renew/<id>`` (404 once
  it expired), ``/v1/session/destroy/<id>``; a session past its TTL is invalidated, and
  an invalidated session's locks are released (behavior ``release``);
- locks: ``PUT /v1/kv/<key>?acquire=<session>`` takes the key's lock if nobody else
  holds it (``LockIndex`` counts the acquisitions, ``Session`` names the holder),
  ``?release=<session>`` lets it go; either answers ``false`` when it cannot. Consul's
  lock-delay is not implemented: the adapter creates its sessions with none;
- ``restore_snapshot()`` makes indexes go backwards, as restoring a snapshot can.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import re
import socket
import threading
import time
import uuid
from collections.abc import Coroutine
from typing import Any, TypeVar

from aiohttp import web

DATACENTER = "dc1"
T = TypeVar("T")


def parse_wait(text: str) -> float:
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(ms|s|m)?", text or "300s")
    if not match:
        raise web.HTTPBadRequest(text=f"invalid wait {text!r}")
    value, unit = float(match.group(1)), match.group(2) or "s"
    return value / 1000 if unit == "ms" else value * 60 if unit == "m" else value


class ConsulDouble:
    def __init__(self) -> None:
        self.index = 1
        self.kv: dict[str, tuple[bytes, int, int]] = {}  # key -> (value, create, modify)
        self.locks: dict[str, tuple[str, int]] = {}  # key -> (holding session, lock index)
        self.sessions: dict[str, tuple[float, float]] = {}  # id -> (ttl_s, expires at)
        self.services: dict[str, dict[str, Any]] = {}  # id -> registration
        self.services_index = 1
        self.requests: list[str] = []
        self._stopping = False
        self._changed = asyncio.Condition()
        self._runner: web.AppRunner | None = None

    # -- lifecycle ---------------------------------------------------------------

    async def start(self, port: int = 0) -> str:
        """Serves on ``port`` (a free one when 0); returns host:port."""
        if not port:
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                port = sock.getsockname()[1]
        app = web.Application()
        app.router.add_get("/v1/kv/{key:.+}", self._kv_get)
        app.router.add_put("/v1/kv/{key:.+}", self._kv_put)
        app.router.add_delete("/v1/kv/{key:.+}", self._kv_delete)
        app.router.add_put("/v1/session/create", self._session_create)
        app.router.add_put("/v1/session/renew/{id}", self._session_renew)
        app.router.add_put("/v1/session/destroy/{id}", self._session_destroy)
        app.router.add_get("/v1/health/service/{name}", self._health)
        app.router.add_put("/v1/agent/service/register", self._register)
        app.router.add_put("/v1/agent/service/deregister/{id}", self._deregister)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", port, reuse_address=True)
        await site.start()
        self._stopping = False
        return f"127.0.0.1:{port}"

    async def stop(self) -> None:
        # Blocked queries answer now; the server does not wait out their ``wait``.
        self._stopping = True
        await self._notify()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def restore_snapshot(self) -> None:
        """Every index drops back (values stay), as after a snapshot restore."""
        self.index = 1
        self.kv = {k: (v, 1, 1) for k, (v, _, _) in self.kv.items()}
        self.services_index = 1
        await self._notify()

    # -- handlers ----------------------------------------------------------------

    async def _block(self, request: web.Request, current: Any) -> None:
        """Holds a blocking query until ``current()`` passes its index or its wait ends."""
        self.requests.append(str(request.rel_url))
        if "index" not in request.query:
            return
        index = int(request.query["index"])
        wait = parse_wait(request.query.get("wait", ""))

        async def changed() -> None:
            async with self._changed:
                await self._changed.wait_for(lambda: self._stopping or current() != index)

        with contextlib.suppress(TimeoutError):  # the wait ran out: answer unchanged
            await asyncio.wait_for(changed(), wait)

    async def _kv_get(self, request: web.Request) -> web.Response:
        key = request.match_info["key"]
        if "recurse" in request.query:
            return await self._kv_get_prefix(request, key)

        def current() -> int:
            entry = self.kv.get(key)
            return entry[2] if entry else self.index

        await self._block(request, current)
        headers = {"X-Consul-Index": str(current())}
        entry = self.kv.get(key)
        if entry is None:
            return web.Response(status=404, headers=headers)
        return web.json_response([self._kv_entry(key)], headers=headers)

    def _kv_entry(self, key: str) -> dict[str, Any]:
        value, create, modify = self.kv[key]
        self._expire_sessions()
        holder, lock_index = self.locks.get(key, ("", 0))
        entry = {
            "Key": key,
            "Flags": 0,
            "LockIndex": lock_index,
            "CreateIndex": create,
            "ModifyIndex": modify,
            "Value": base64.b64encode(value).decode(),
        }
        return entry | ({"Session": holder} if holder else {})

    async def _kv_get_prefix(self, request: web.Request, prefix: str) -> web.Response:
        # Any KV change wakes a prefix query (Consul may wake them spuriously too).
        await self._block(request, lambda: self.index)
        headers = {"X-Consul-Index": str(self.index)}
        body = [self._kv_entry(key) for key in sorted(self.kv) if key.startswith(prefix)]
        if not body:
            return web.Response(status=404, headers=headers)
        return web.json_response(body, headers=headers)

    async def _kv_put(self, request: web.Request) -> web.Response:
        key, value = request.match_info["key"], await request.read()
        existing = self.kv.get(key)
        if "cas" in request.query:
            cas = int(request.query["cas"])
            if (cas == 0 and existing) or (cas and (not existing or existing[2] != cas)):
                return web.json_response(False)
        if not self._lock_op(key, request.query.get("acquire"), request.query.get("release")):
            return web.json_response(False)
        self.index += 1
        self.kv[key] = (value, existing[1] if existing else self.index, self.index)
        await self._notify()
        return web.json_response(True)

    async def _kv_delete(self, request: web.Request) -> web.Response:
        if self.kv.pop(request.match_info["key"], None) is not None:
            self.index += 1
            await self._notify()
        return web.json_response(True)

    def _lock_op(self, key: str, acquire: str | None, release: str | None) -> bool:
        """Applies ``?acquire=`` / ``?release=``; False when the lock cannot change so."""
        self._expire_sessions()
        holder, lock_index = self.locks.get(key, ("", 0))
        if acquire is not None:
            if acquire not in self.sessions or holder not in ("", acquire):
                return False
            self.locks[key] = (acquire, lock_index if holder else lock_index + 1)
        if release is not None:
            if holder != release:
                return False
            self.locks[key] = ("", lock_index)
        return True

    def _expire_sessions(self) -> None:
        now = time.monotonic()
        for session, (_, expires) in list(self.sessions.items()):
            if expires <= now:
                self._invalidate(session)

    def _invalidate(self, session: str) -> None:
        self.sessions.pop(session, None)
        for key, (holder, lock_index) in list(self.locks.items()):
            if holder == session:
                self.locks[key] = ("", lock_index)
                self.index += 1
                value, create, _ = self.kv[key]
                self.kv[key] = (value, create, self.index)

    async def _session_create(self, request: web.Request) -> web.Response:
        body = await request.read()
        spec = {k.lower(): v for k, v in (json.loads(body) if body else {}).items()}
        ttl = parse_wait(spec["ttl"]) if spec.get("ttl") else float("inf")
        session = str(uuid.uuid4())
        self.sessions[session] = (ttl, time.monotonic() + ttl)
        return web.json_response({"ID": session})

    async def _session_renew(self, request: web.Request) -> web.Response:
        self._expire_sessions()
        session = request.match_info["id"]
        if session not in self.sessions:
            return web.Response(status=404, text=f"Session id '{session}' not found")
        ttl, _ = self.sessions[session]
        self.sessions[session] = (ttl, time.monotonic() + ttl)
        return web.json_response([{"ID": session, "TTL": f"{ttl:g}s"}])

    async def _session_destroy(self, request: web.Request) -> web.Response:
        self._invalidate(request.match_info["id"])
        await self._notify()
        return web.json_response(True)

    async def _health(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        await self._block(request, lambda: self.services_index)
        entries = [
            {
                "Node": {"Node": "node1", "Address": "127.0.0.1", "Datacenter": DATACENTER},
                "Service": {
                    "ID": s["id"],
                    "Service": s["name"],
                    "Address": s.get("address", ""),
                    "Port": s.get("port", 0),
                    "Meta": s.get("meta") or {},
                    "Tags": s.get("tags") or [],
                },
                "Checks": [],
            }
            for s in self.services.values()
            if s["name"] == name
        ]
        return web.json_response(entries, headers={"X-Consul-Index": str(self.services_index)})

    async def _register(self, request: web.Request) -> web.Response:
        # The agent API takes field names in any case.
        doc = {k.lower(): v for k, v in json.loads(await request.read()).items()}
        doc.setdefault("id", doc["name"])
        self.services[doc["id"]] = doc
        await self._bump_services()
        return web.Response()

    async def _deregister(self, request: web.Request) -> web.Response:
        self.services.pop(request.match_info["id"], None)
        await self._bump_services()
        return web.Response()

    async def _bump_services(self) -> None:
        self.index += 1
        self.services_index = self.index
        await self._notify()

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()


class ConsulDoubleThread:
    """The double served from its own event loop in a background thread, for tests whose
    router runs in another process."""

    def __init__(self) -> None:
        self.double = ConsulDouble()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self.address = ""

    def __enter__(self) -> ConsulDoubleThread:
        self._thread.start()
        self.address = self._run(self.double.start())
        return self

    def __exit__(self, *exc: object) -> None:
        self._run(self.double.stop())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(10)

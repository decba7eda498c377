"""Redis session store, for several context replicas sharing sessions.

Per session: a hash (system prompt, metadata, summary), a list of turns (JSON) and a set
of the request ids already appended. Per tenant, a sorted set of session ids pages
``list``; one sorted set holds every session's expiry time, by the store's clock, slid on
every access: a session past it is gone for every operation, and ``sweep`` deletes it.
Redis expires the keys too (PEXPIRE, slid alike), so that nothing outlives a store that
stops sweeping. An append is one Lua
script, so concurrent appends to a session land whole, one after the other. Durability is
the server's: run it with ``appendonly yes`` and ``appendfsync always`` so that a reply
means the append is on disk.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any
from urllib.parse import quote, unquote

import redis.asyncio as redis

from llmmesh.types import Role, Turn, request_text
from services.context.store import Appended, Session, SessionExists, now_ms

_APPEND = """
local expires = redis.call('ZSCORE', KEYS[5], ARGV[4])
if expires and tonumber(expires) <= tonumber(ARGV[3]) then
  redis.call('DEL', KEYS[1], KEYS[2], KEYS[3])  -- expired, not swept yet: starts over
end
if redis.call('EXISTS', KEYS[1]) == 0 then
  redis.call('HSET', KEYS[1], 'system_prompt', '', 'metadata', '{}', 'summary', '',
             'summarized_turns', '0')
end
local added = redis.call('SADD', KEYS[3], ARGV[1])
if added == 1 then
  for i = 7, #ARGV do redis.call('RPUSH', KEYS[2], ARGV[i]) end
else  -- a stored id again: the same request text (ARGV[6]) is a retry, another a conflict
  local before = nil
  for _, doc in ipairs(redis.call('LRANGE', KEYS[2], 0, -1)) do
    local turn = cjson.decode(doc)
    if turn.request_id == ARGV[1] then
      if turn.role == 'user' then before = turn.text break end
      if before == nil then before = turn.text end
    end
  end
  if before ~= nil and before ~= ARGV[6] then added = -1 end
end
local count = redis.call('LLEN', KEYS[2])
for i = 1, 3 do redis.call('PEXPIRE', KEYS[i], ARGV[2]) end
redis.call('ZADD', KEYS[4], 0, ARGV[5])
redis.call('ZADD', KEYS[5], tonumber(ARGV[3]) + tonumber(ARGV[2]), ARGV[4])
return {count, added}
"""
# Reads a session and slides its expiry (never shortening it), if it exists.
_LOAD = """
local expires = redis.call('ZSCORE', KEYS[4], ARGV[3])
if expires and tonumber(expires) <= tonumber(ARGV[2]) then return false end
local meta = redis.call('HGETALL', KEYS[1])
if #meta == 0 then return false end
local turns = redis.call('LRANGE', KEYS[2], 0, -1)
for i = 1, 3 do redis.call('PEXPIRE', KEYS[i], ARGV[1], 'GT') end
redis.call('ZADD', KEYS[4], 'GT', tonumber(ARGV[2]) + tonumber(ARGV[1]), ARGV[3])
return {meta, turns}
"""
# Only while the session exists: a summary must not resurrect a deleted session.
_SAVE_SUMMARY = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
if ARGV[3] ~= '' then
  local covered = tonumber(redis.call('HGET', KEYS[1], 'summarized_turns') or '0')
  if covered ~= tonumber(ARGV[3]) then return 0 end
end
redis.call('HSET', KEYS[1], 'summary', ARGV[1], 'summarized_turns', ARGV[2])
return 1
"""
# A copy of a live session (KEYS 1-3) as a new one (KEYS 4-6) with its own system prompt
# and metadata; false if the source is gone, -1 if the new one exists.
_FORK = """
local function live(key, member)
  local expires = redis.call('ZSCORE', KEYS[8], member)
  if expires and tonumber(expires) <= tonumber(ARGV[1]) then return false end
  return redis.call('EXISTS', key) == 1
end
if not live(KEYS[1], ARGV[3]) then return false end
if live(KEYS[4], ARGV[4]) then return -1 end
redis.call('DEL', KEYS[4], KEYS[5], KEYS[6])
local source = redis.call('HGETALL', KEYS[1])
redis.call('HSET', KEYS[4], unpack(source))
redis.call('HSET', KEYS[4], 'system_prompt', ARGV[6], 'metadata', ARGV[7])
local function copy(command, key, items)  -- in batches: unpack's stack is bounded
  for i = 1, #items, 1000 do
    redis.call(command, key, unpack(items, i, math.min(i + 999, #items)))
  end
end
local turns = redis.call('LRANGE', KEYS[2], 0, -1)
copy('RPUSH', KEYS[5], turns)
copy('SADD', KEYS[6], redis.call('SMEMBERS', KEYS[3]))
for i = 4, 6 do redis.call('PEXPIRE', KEYS[i], ARGV[2]) end
redis.call('ZADD', KEYS[7], 0, ARGV[5])
redis.call('ZADD', KEYS[8], tonumber(ARGV[1]) + tonumber(ARGV[2]), ARGV[4])
return #turns
"""
_SWEEP_BATCH = 1000
_APPENDED = {1: Appended.APPENDED, 0: Appended.DUPLICATE, -1: Appended.CONFLICT}


class RedisSessionStore:
    def __init__(
        self, url: str, prefix: str = "llm-mesh:ctx:", clock: Callable[[], int] = now_ms
    ) -> None:
        self._client = redis.Redis.from_url(url, decode_responses=True)
        self._now = clock  # wall-clock milliseconds, as every replica of the store sees it
        self._prefix = prefix
        self._append = self._client.register_script(_APPEND)
        self._load = self._client.register_script(_LOAD)
        self._save_summary = self._client.register_script(_SAVE_SUMMARY)
        self._fork = self._client.register_script(_FORK)

    async def open(self) -> None:
        await self._client.ping()  # type: ignore[misc]  # redis-py types sync and async alike

    async def close(self) -> None:
        await self._client.aclose()

    def _keys(self, tenant: str, session_id: str) -> tuple[str, str, str]:
        base = f"{quote(tenant, safe='')}:{session_id}"
        p = self._prefix
        return f"{p}s:{base}", f"{p}t:{base}", f"{p}r:{base}"

    def _index(self, tenant: str) -> str:
        return f"{self._prefix}idx:{quote(tenant, safe='')}"

    @property
    def _expiry(self) -> str:
        return f"{self._prefix}exp"

    @staticmethod
    def _member(tenant: str, session_id: str) -> str:
        return f"{quote(tenant, safe='')}\n{session_id}"

    async def load(self, tenant: str, session_id: str, ttl_ms: int) -> Session | None:
        keys = [*self._keys(tenant, session_id), self._expiry]
        args: list[str | int] = [ttl_ms, self._now(), self._member(tenant, session_id)]
        found = await self._load(keys=keys, args=args)
        if not found:
            return None
        flat, turns = found
        meta = dict(zip(flat[::2], flat[1::2], strict=True))
        return Session(
            system_prompt=meta.get("system_prompt", ""),
            metadata=json.loads(meta.get("metadata", "{}")),
            turns=[_turn(json.loads(t)) for t in turns],
            summary=meta.get("summary", ""),
            summarized_turns=int(meta.get("summarized_turns", 0)),
        )

    async def append(
        self, tenant: str, session_id: str, request_id: str, turns: list[Turn], ttl_ms: int
    ) -> tuple[int, Appended]:
        now = self._now()
        keys = [*self._keys(tenant, session_id), self._index(tenant), self._expiry]
        args: list[str | int] = [
            request_id,
            ttl_ms,
            now,
            self._member(tenant, session_id),
            session_id,
            request_text(turns) or "",
        ]
        # Unescaped: the script compares texts as Lua's cjson decodes them.
        args += [json.dumps(_turn_doc(t, request_id, now), ensure_ascii=False) for t in turns]
        count, added = await self._append(keys=keys, args=args)
        return int(count), _APPENDED[int(added)]

    async def put(
        self,
        tenant: str,
        session_id: str,
        system_prompt: str,
        metadata: dict[str, str],
        ttl_ms: int,
    ) -> None:
        meta_key, turns_key, requests_key = self._keys(tenant, session_id)
        async with self._client.pipeline(transaction=True) as pipe:
            pipe.hsetnx(meta_key, "summary", "")
            pipe.hsetnx(meta_key, "summarized_turns", "0")
            pipe.hset(
                meta_key,
                mapping={"system_prompt": system_prompt, "metadata": json.dumps(metadata)},
            )
            for key in (meta_key, turns_key, requests_key):
                pipe.pexpire(key, ttl_ms)
            pipe.zadd(self._index(tenant), {session_id: 0})
            pipe.zadd(self._expiry, {self._member(tenant, session_id): self._now() + ttl_ms})
            await pipe.execute()

    async def fork(
        self,
        tenant: str,
        source_id: str,
        session_id: str,
        *,
        system_prompt: str,
        metadata: dict[str, str],
        ttl_ms: int,
    ) -> int | None:
        keys = [
            *self._keys(tenant, source_id),
            *self._keys(tenant, session_id),
            self._index(tenant),
            self._expiry,
        ]
        args: list[str | int] = [
            self._now(),
            ttl_ms,
            self._member(tenant, source_id),
            self._member(tenant, session_id),
            session_id,
            system_prompt,
            json.dumps(metadata),
        ]
        count = await self._fork(keys=keys, args=args)
        if count is None:
            return None
        if int(count) < 0:
            raise SessionExists(session_id)
        return int(count)

    async def save_summary(
        self,
        tenant: str,
        session_id: str,
        summary: str,
        summarized_turns: int,
        replaces: int | None = None,
    ) -> bool:
        meta_key = self._keys(tenant, session_id)[0]
        expected = "" if replaces is None else str(replaces)
        saved = await self._save_summary(
            keys=[meta_key], args=[summary, summarized_turns, expected]
        )
        return bool(saved)

    async def delete(self, tenant: str, session_id: str) -> bool:
        async with self._client.pipeline(transaction=True) as pipe:
            pipe.delete(*self._keys(tenant, session_id))
            pipe.zrem(self._index(tenant), session_id)
            pipe.zrem(self._expiry, self._member(tenant, session_id))
            deleted, *_ = await pipe.execute()
        return bool(deleted)

    async def list(self, tenant: str, after: str, limit: int) -> list[str]:
        found: list[str] = []
        start = f"({after}" if after else "-"
        while len(found) < limit:
            ids = await self._client.zrangebylex(self._index(tenant), start, "+", 0, limit)
            if not ids:
                break
            expiries = await self._client.zmscore(
                self._expiry, [self._member(tenant, i) for i in ids]
            )
            now = self._now()
            found += [i for i, e in zip(ids, expiries, strict=True) if e and e > now]
            start = f"({ids[-1]}"
        return found[:limit]

    async def sweep(self) -> int:
        """Deletes the sessions past their expiry, and their ids from the indexes."""
        swept = 0
        while True:
            members = await self._client.zrangebyscore(
                self._expiry, "-inf", self._now(), 0, _SWEEP_BATCH
            )
            if not members:
                return swept
            async with self._client.pipeline(transaction=False) as pipe:
                for member in members:
                    quoted, session_id = member.split("\n", 1)
                    pipe.zrem(f"{self._prefix}idx:{quoted}", session_id)
                    pipe.delete(*self._keys(unquote(quoted), session_id))
                pipe.zrem(self._expiry, *members)
                await pipe.execute()
            swept += len(members)


def _turn_doc(turn: Turn, request_id: str, now: int) -> dict[str, Any]:
    return {
        "role": turn.role.value,
        "text": turn.text,
        "token_count": turn.token_count,
        "request_id": request_id,
        "created_at_ms": now,
    }


def _turn(doc: dict[str, Any]) -> Turn:
    return Turn(
        Role(doc["role"]),
        doc["text"],
        int(doc["token_count"]),
        doc["request_id"],
        int(doc["created_at_ms"]),
    )

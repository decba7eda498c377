"""Tenant budgets in Redis, one set for every router: each check-and-charge is one Lua
script, so N routers enforce one limit.

Per tenant, a hash holds both token buckets (level and when it was last refilled, by
Redis's own clock, so the routers' clocks do not matter) and one field per router with
the streams it has open there. A router that dies leaves its field behind: only the
fields of routers whose heartbeat is fresh (fleet.py) count, and a dead router's is
deleted by the next admission that sees it.
"""

from __future__ import annotations

from typing import Any

import redis.asyncio as redis

from services.router.shared.budgets import Admitted, Grant, Granted, Limits, Refusal

# KEYS: the tenant's hash, the routers' heartbeats (sorted set, score: ms).
# ARGV: requests/min, tokens/min, max streams (0: none), prompt tokens, this router's
# id, heartbeats older than this many ms are dead.
_ADMIT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local rpm, tpm, max_streams = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local prompt, me, stale_ms = tonumber(ARGV[4]), ARGV[5], tonumber(ARGV[6])
local function level(name, cap)
  local l = tonumber(redis.call('HGET', KEYS[1], name .. ':l'))
  if l == nil then return cap end
  local u = tonumber(redis.call('HGET', KEYS[1], name .. ':u'))
  return math.min(cap, l + (now - u) * cap / 60)
end
if max_streams > 0 then
  local fields = redis.call('HGETALL', KEYS[1])
  local open = 0
  local alive_after = now * 1000 - stale_ms
  for i = 1, #fields, 2 do
    local router = string.match(fields[i], '^s:(.+)$')
    if router then
      local beat = tonumber(redis.call('ZSCORE', KEYS[2], router))
      if router == me or (beat and beat >= alive_after) then
        open = open + tonumber(fields[i + 1])
      else
        redis.call('HDEL', KEYS[1], fields[i])
      end
    end
  end
  if open >= max_streams then return {'streams', '1', tostring(open)} end
end
local rl, tl = nil, nil
if rpm > 0 then
  rl = level('r', rpm)
  if rl < 1 then return {'requests', tostring((1 - rl) * 60 / rpm), ''} end
end
if tpm > 0 then
  tl = level('t', tpm)
  if tl < prompt then return {'tokens', tostring((prompt - tl) * 60 / tpm), ''} end
end
if rl then redis.call('HSET', KEYS[1], 'r:l', tostring(rl - 1), 'r:u', tostring(now)) end
if tl then redis.call('HSET', KEYS[1], 't:l', tostring(tl - prompt), 't:u', tostring(now)) end
redis.call('HINCRBY', KEYS[1], 's:' .. me, 1)
redis.call('PEXPIRE', KEYS[1], 3600000)
return {'ok', tl and tostring(tl - prompt) or '', rl and tostring(rl - 1) or ''}
"""
# KEYS: the tenant's hash. ARGV: tokens/min, tokens generated.
_CHARGE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local tpm, spent = tonumber(ARGV[1]), tonumber(ARGV[2])
local l = tonumber(redis.call('HGET', KEYS[1], 't:l'))
if l == nil then l = tpm else
  local u = tonumber(redis.call('HGET', KEYS[1], 't:u'))
  l = math.min(tpm, l + (now - u) * tpm / 60)
end
l = l - spent
redis.call('HSET', KEYS[1], 't:l', tostring(l), 't:u', tostring(now))
return tostring(l)
"""
# KEYS: the tenant's hash. ARGV: this router's id, tokens/min (0: none), tokens generated
# since the last charge: the stream's last charge and its slot back, in one call.
_RELEASE = """
local tpm, spent = tonumber(ARGV[2]), tonumber(ARGV[3])
if tpm > 0 and spent > 0 then
  local t = redis.call('TIME')
  local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
  local l = tonumber(redis.call('HGET', KEYS[1], 't:l'))
  if l == nil then l = tpm else
    local u = tonumber(redis.call('HGET', KEYS[1], 't:u'))
    l = math.min(tpm, l + (now - u) * tpm / 60)
  end
  redis.call('HSET', KEYS[1], 't:l', tostring(l - spent), 't:u', tostring(now))
end
local left = redis.call('HINCRBY', KEYS[1], 's:' .. ARGV[1], -1)
if left <= 0 then redis.call('HDEL', KEYS[1], 's:' .. ARGV[1]) end
return left
"""

# KEYS: the tenant's hash. ARGV: this router's id, requests/min, tokens/min (0: none),
# the prompt's tokens: an admission undone.
_CANCEL = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local function give_back(name, cap, amount)
  local l = tonumber(redis.call('HGET', KEYS[1], name .. ':l'))
  if cap <= 0 or l == nil then return end
  local u = tonumber(redis.call('HGET', KEYS[1], name .. ':u'))
  l = math.min(cap, l + (now - u) * cap / 60 + amount)
  redis.call('HSET', KEYS[1], name .. ':l', tostring(l), name .. ':u', tostring(now))
end
give_back('r', tonumber(ARGV[2]), 1)
give_back('t', tonumber(ARGV[3]), tonumber(ARGV[4]))
local left = redis.call('HINCRBY', KEYS[1], 's:' .. ARGV[1], -1)
if left <= 0 then redis.call('HDEL', KEYS[1], 's:' .. ARGV[1]) end
return left
"""

# KEYS: the tenant's hash. ARGV: requests/min, tokens/min (0: none), requests and tokens
# this router needs now, and as much again it would like to hold ahead of need: all that is
# wanted the bucket holds (at least what is needed), or nothing and the wait for it.
_GRANT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local rpm, tpm = tonumber(ARGV[1]), tonumber(ARGV[2])
local need_r, need_t = tonumber(ARGV[3]), tonumber(ARGV[4])
local want_r, want_t = tonumber(ARGV[5]), tonumber(ARGV[6])
local function level(name, cap)
  local l = tonumber(redis.call('HGET', KEYS[1], name .. ':l'))
  if l == nil then return cap end
  local u = tonumber(redis.call('HGET', KEYS[1], name .. ':u'))
  return math.min(cap, l + (now - u) * cap / 60)
end
local rl, tl = 0, 0
if rpm > 0 then
  rl = level('r', rpm)
  if rl < need_r then return {'requests', tostring((need_r - rl) * 60 / rpm), '', '', ''} end
end
if tpm > 0 then
  tl = level('t', tpm)
  if tl < need_t then return {'tokens', tostring((need_t - tl) * 60 / tpm), '', '', ''} end
end
local gr, gt = 0, 0
if rpm > 0 then
  gr = math.max(need_r, math.min(want_r, math.floor(rl)))
  redis.call('HSET', KEYS[1], 'r:l', tostring(rl - gr), 'r:u', tostring(now))
end
if tpm > 0 then
  gt = math.max(need_t, math.min(want_t, tl))
  redis.call('HSET', KEYS[1], 't:l', tostring(tl - gt), 't:u', tostring(now))
end
redis.call('PEXPIRE', KEYS[1], 3600000)
return {'ok', tostring(gr), tostring(gt), tostring(tl - gt), tostring(rl - gr)}
"""
# KEYS: the tenant's hash. ARGV: requests/min, tokens/min (0: none), requests and tokens
# a router held and did not spend.
_GIVE_BACK = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local function give_back(name, cap, amount)
  local l = tonumber(redis.call('HGET', KEYS[1], name .. ':l'))
  if cap <= 0 or l == nil or amount <= 0 then return end
  local u = tonumber(redis.call('HGET', KEYS[1], name .. ':u'))
  l = math.min(cap, l + (now - u) * cap / 60 + amount)
  redis.call('HSET', KEYS[1], name .. ':l', tostring(l), name .. ':u', tostring(now))
end
give_back('r', tonumber(ARGV[1]), tonumber(ARGV[3]))
give_back('t', tonumber(ARGV[2]), tonumber(ARGV[4]))
return 'ok'
"""


class RedisBudgets:
    """Budgets in Redis under ``prefix``, charged as router ``router_id``."""

    def __init__(
        self, client: redis.Redis, prefix: str, router_id: str, stale_after_s: float
    ) -> None:
        self._client = client
        self._prefix = prefix
        self._router = router_id
        self._stale_ms = int(stale_after_s * 1000)
        self._admit: Any = client.register_script(_ADMIT)
        self._charge: Any = client.register_script(_CHARGE)
        self._release: Any = client.register_script(_RELEASE)
        self._cancel: Any = client.register_script(_CANCEL)
        self._grant: Any = client.register_script(_GRANT)
        self._give_back: Any = client.register_script(_GIVE_BACK)

    async def warm(self) -> None:
        """The scripts loaded and a connection open, before the first admission (a cold
        first call, connecting and loading its script, could outlast the timeout)."""
        scripts = (self._admit, self._charge, self._release, self._cancel, self._grant)
        for script in (*scripts, self._give_back):
            await self._client.script_load(script.script)

    def _key(self, tenant: str) -> str:
        return f"{self._prefix}budget:{tenant}"

    @property
    def heartbeats_key(self) -> str:
        return f"{self._prefix}routers"

    async def admit(self, tenant: str, limits: Limits, prompt_tokens: int) -> Admitted | Refusal:
        outcome, value, detail = await self._admit(
            keys=[self._key(tenant), self.heartbeats_key],
            args=[
                limits.requests_per_minute or 0,
                limits.tokens_per_minute or 0,
                limits.max_streams or 0,
                prompt_tokens,
                self._router,
                self._stale_ms,
            ],
        )
        outcome, value = _text(outcome), _text(value)
        if outcome == "ok":
            return Admitted(_number(value), _number(_text(detail)))
        detail = _text(detail)
        return Refusal(outcome, float(value), f"{detail} streams open" if detail else "")

    async def charge(self, tenant: str, limits: Limits, tokens: int) -> float | None:
        if limits.tokens_per_minute is None:
            return None
        left = await self._charge(keys=[self._key(tenant)], args=[limits.tokens_per_minute, tokens])
        return float(_text(left))

    async def release(self, tenant: str, limits: Limits | None = None, tokens: int = 0) -> None:
        tpm = (limits.tokens_per_minute or 0) if limits is not None else 0
        await self._release(keys=[self._key(tenant)], args=[self._router, tpm, tokens])

    async def cancel(self, tenant: str, limits: Limits, prompt_tokens: int) -> None:
        rpm, tpm = limits.requests_per_minute or 0, limits.tokens_per_minute or 0
        await self._cancel(keys=[self._key(tenant)], args=[self._router, rpm, tpm, prompt_tokens])

    async def grant(
        self, tenant: str, limits: Limits, need: Grant, want: Grant
    ) -> Granted | Refusal:
        """Takes ``need`` and up to ``want`` more from the tenant's buckets, for this router
        to spend locally; or nothing, and how long until ``need`` is there."""
        outcome, requests, tokens, left, requests_left = await self._grant(
            keys=[self._key(tenant)],
            args=[
                limits.requests_per_minute or 0,
                limits.tokens_per_minute or 0,
                need.requests,
                need.tokens,
                need.requests + want.requests,
                need.tokens + want.tokens,
            ],
        )
        outcome = _text(outcome)
        if outcome != "ok":
            return Refusal(outcome, float(_text(requests)))
        grant = Grant(float(_text(requests)), float(_text(tokens)))
        return Granted(grant, float(_text(left)), float(_text(requests_left)))

    async def give_back(self, tenant: str, limits: Limits, unspent: Grant) -> None:
        """Returns what a router held and did not spend (its requests and tokens)."""
        rpm, tpm = limits.requests_per_minute or 0, limits.tokens_per_minute or 0
        await self._give_back(
            keys=[self._key(tenant)], args=[rpm, tpm, unspent.requests, unspent.tokens]
        )


def _number(text: str) -> float | None:
    return float(text) if text else None


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value

"""Admission without a round trip to Redis: each router spends an allowance of each tenant's
request and token budgets, taken from the shared buckets ahead of need.

An allowance is taken out of the bucket before it is spent, so the routers together never
admit more than the bucket holds: sharing stays exact, and the round trip moves off the
request's path. Each router asks for ``ahead_s`` seconds of the tenant's rate (topped up
in the background once half of it is spent) and gives back what it has not spent after
``idle_s``: what one router holds and another cannot use is at most that much of the
tenant's rate. A request the allowance cannot cover asks Redis itself (one round trip,
as without allowances), and is refused only if the bucket cannot cover it either.

Concurrent-stream caps are counted exactly, not in allowances: a tenant with one is
admitted by RedisBudgets' own script, one round trip per admission and per release.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from services.router.shared.budgets import Admitted, Grant, Granted, Limits, Refusal
from services.router.shared.redis_budgets import RedisBudgets
from services.router.shared.resilient import REDIS_ERRORS

log = logging.getLogger(__name__)


@dataclass
class _Allowance:
    limits: Limits
    requests: float = 0.0
    tokens: float = 0.0
    bucket_left: float = 0.0  # tokens the shared bucket held after the last grant
    bucket_requests: float = 0.0  # and requests
    used_at: float = 0.0
    topping_up: asyncio.Task[None] | None = None

    def covers(self, need: Grant) -> bool:
        return self.requests >= need.requests and self.tokens >= need.tokens

    def add(self, grant: Grant, sign: float = 1.0) -> None:
        self.requests += sign * grant.requests
        self.tokens += sign * grant.tokens

    def tokens_left(self) -> float | None:
        if self.limits.tokens_per_minute is None:
            return None
        return self.tokens + self.bucket_left

    def requests_left(self) -> float | None:
        if self.limits.requests_per_minute is None:
            return None
        return self.requests + self.bucket_requests

    def granted(self, granted: Granted) -> None:
        self.add(granted.grant)
        self.bucket_left, self.bucket_requests = granted.tokens_left, granted.requests_left


class AllowanceBudgets:
    """The Budgets a router charges over ``shared``, spending allowances locally."""

    def __init__(
        self,
        shared: RedisBudgets,
        ahead_s: float,
        idle_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._shared = shared
        self._ahead_s = ahead_s
        self._idle_s = idle_s
        self._clock = clock
        self._allowances: dict[str, _Allowance] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    async def admit(self, tenant: str, limits: Limits, prompt_tokens: int) -> Admitted | Refusal:
        if limits.max_streams is not None:
            return await self._shared.admit(tenant, limits, prompt_tokens)
        need = self._need(limits, prompt_tokens)
        if not need.requests and limits.tokens_per_minute is None:
            return Admitted(None)  # nothing to count
        allowance = self._allowance(tenant, limits)
        if not allowance.covers(need):
            granted = await self._shared.grant(tenant, limits, need, self._ahead(limits))
            if isinstance(granted, Refusal):
                return granted
            allowance.granted(granted)
        allowance.add(need, -1.0)
        self._top_up_if_low(tenant, allowance)
        return Admitted(allowance.tokens_left(), allowance.requests_left())

    async def charge(self, tenant: str, limits: Limits, tokens: int) -> float | None:
        if limits.max_streams is not None:
            return await self._shared.charge(tenant, limits, tokens)
        if limits.tokens_per_minute is None:
            return None
        allowance = self._allowance(tenant, limits)
        allowance.tokens -= tokens
        if allowance.tokens < 0:  # generated beyond the allowance: charged to the bucket
            deficit, allowance.tokens = -allowance.tokens, 0.0
            left = await self._shared.charge(tenant, limits, int(deficit + 0.999))
            allowance.bucket_left = left if left is not None else 0.0
        self._top_up_if_low(tenant, allowance)
        return allowance.tokens_left()

    async def release(self, tenant: str, limits: Limits | None = None, tokens: int = 0) -> None:
        if limits is None or limits.max_streams is not None:
            await self._shared.release(tenant, limits, tokens)
        elif tokens:
            await self.charge(tenant, limits, tokens)

    async def cancel(self, tenant: str, limits: Limits, prompt_tokens: int) -> None:
        if limits.max_streams is not None:
            await self._shared.cancel(tenant, limits, prompt_tokens)
            return
        self._allowance(tenant, limits).add(self._need(limits, prompt_tokens))

    async def run(self) -> None:
        """Gives back, every ``idle_s``, the allowances not spent from for that long."""
        while True:
            await asyncio.sleep(self._idle_s)  # the give-back period
            now = self._clock()
            for tenant, allowance in list(self._allowances.items()):
                if now - allowance.used_at >= self._idle_s:
                    await self._give_back(tenant, allowance)

    async def close(self) -> None:
        """Gives back every allowance (a router leaving the fleet), top-ups included."""
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for tenant, allowance in list(self._allowances.items()):
            await self._give_back(tenant, allowance)

    def _allowance(self, tenant: str, limits: Limits) -> _Allowance:
        allowance = self._allowances.get(tenant)
        if allowance is None or allowance.limits != limits:
            if allowance is not None:  # the tenant's limits changed: start again
                self._background(self._give_back(tenant, allowance))
            allowance = self._allowances[tenant] = _Allowance(limits)
        allowance.used_at = self._clock()
        return allowance

    @staticmethod
    def _need(limits: Limits, prompt_tokens: int) -> Grant:
        """What one admission takes: a request, and its prompt's tokens."""
        return Grant(
            1.0 if limits.requests_per_minute is not None else 0.0,
            float(prompt_tokens) if limits.tokens_per_minute is not None else 0.0,
        )

    def _ahead(self, limits: Limits) -> Grant:
        seconds = self._ahead_s / 60.0
        return Grant(
            (limits.requests_per_minute or 0.0) * seconds,
            (limits.tokens_per_minute or 0.0) * seconds,
        )

    def _top_up_if_low(self, tenant: str, allowance: _Allowance) -> None:
        ahead = self._ahead(allowance.limits)
        low = allowance.requests < ahead.requests / 2 or allowance.tokens < ahead.tokens / 2
        if not low or (allowance.topping_up is not None and not allowance.topping_up.done()):
            return
        allowance.topping_up = self._background(self._top_up(tenant, allowance, ahead))

    async def _top_up(self, tenant: str, allowance: _Allowance, ahead: Grant) -> None:
        want = Grant(
            max(0.0, ahead.requests - allowance.requests), max(0.0, ahead.tokens - allowance.tokens)
        )
        granted = await self._shared.grant(tenant, allowance.limits, Grant(), want)
        if isinstance(granted, Refusal):
            return  # the bucket is empty: requests will ask for themselves
        if self._allowances.get(tenant) is allowance:
            allowance.granted(granted)
        else:  # given back meanwhile
            await self._shared.give_back(tenant, allowance.limits, granted.grant)

    async def _give_back(self, tenant: str, allowance: _Allowance) -> None:
        if self._allowances.get(tenant) is allowance:
            del self._allowances[tenant]
        unspent = Grant(max(allowance.requests, 0.0), max(allowance.tokens, 0.0))
        allowance.requests = allowance.tokens = 0.0
        if unspent.requests or unspent.tokens:
            with contextlib.suppress(*REDIS_ERRORS):  # lost: the bucket refills by itself
                await self._shared.give_back(tenant, allowance.limits, unspent)

    def _background(self, work: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        error = None if task.cancelled() else task.exception()
        if error is not None:
            log.warning("a budget allowance call failed", extra={"fields": {"error": repr(error)}})

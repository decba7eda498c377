"""Tenant budgets as the routers share them: token buckets (requests and tokens per
minute) and a count of open streams, checked and charged in one step.

The interface is what a router asks of its budget store; ``MemoryBudgets`` keeps them in
this process (one router), ``RedisBudgets`` (redis_budgets.py) in Redis, where every
router charges the same buckets atomically.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class Limits:
    """A tenant's limits (None: unlimited)."""

    requests_per_minute: float | None = None
    tokens_per_minute: float | None = None
    max_streams: int | None = None

    def scaled(self, share: float) -> Limits:
        """These limits cut to ``share`` of themselves (one of N routers on its own)."""

        def cut(value: float | None) -> float | None:
            return None if value is None else value * share

        streams = None if self.max_streams is None else max(1, int(self.max_streams * share))
        return Limits(cut(self.requests_per_minute), cut(self.tokens_per_minute), streams)


@dataclass(frozen=True)
class Refusal:
    """Why a request was not admitted: ``limit`` is streams, requests or tokens."""

    limit: str
    retry_after_s: float
    detail: str = ""
    share: float = 1.0  # of the tenant's limits the refusing bucket holds (SharedBudgets)


@dataclass(frozen=True)
class Admitted:
    """The request was charged; the tokens and requests left in its tenant's buckets after
    it (None: no such budget). With allowances, ``requests_left`` is as of the last grant."""

    tokens_left: float | None
    requests_left: float | None = None
    # Of the tenant's limits, the part these buckets hold: a router on its own while the
    # shared store is out of reach holds 1/N of them (SharedBudgets).
    share: float = 1.0


@dataclass(frozen=True)
class Grant:
    """Requests and tokens of a tenant's buckets, taken by one router to spend locally."""

    requests: float = 0.0
    tokens: float = 0.0


@dataclass(frozen=True)
class Granted:
    """What a router was granted, and the tokens and requests left in the buckets after it."""

    grant: Grant
    tokens_left: float
    requests_left: float = 0.0


class Budgets(Protocol):
    async def admit(
        self, tenant: str, limits: Limits, prompt_tokens: int
    ) -> Admitted | Refusal: ...

    async def charge(self, tenant: str, limits: Limits, tokens: int) -> float | None:
        """Charges generated tokens; the tokens left (None: no token budget)."""
        ...

    async def release(self, tenant: str, limits: Limits | None = None, tokens: int = 0) -> None:
        """A stream of the tenant ended, having generated ``tokens`` since its last charge
        (charged now, with ``limits``)."""
        ...

    async def cancel(self, tenant: str, limits: Limits, prompt_tokens: int) -> None:
        """An admission undone (the request went no further): its request, its prompt's
        tokens and its stream slot given back."""
        ...


@dataclass
class TokenBucket:
    """``capacity`` per minute, refilled continuously; the level may go below zero when a
    charge arrives after the fact (tokens already generated)."""

    capacity: float
    level: float
    updated: float = field(default_factory=time.monotonic)

    @property
    def rate_per_s(self) -> float:
        return self.capacity / 60.0

    def refill(self, now: float) -> float:
        self.level = min(self.capacity, self.level + (now - self.updated) * self.rate_per_s)
        self.updated = now
        return self.level

    def seconds_until(self, amount: float, now: float) -> float:
        return max(0.0, (amount - self.refill(now)) / self.rate_per_s)

    def resized(self, capacity: float) -> TokenBucket:
        """The bucket at a new capacity, keeping what was spent."""
        return TokenBucket(capacity, min(self.level, capacity), self.updated)


@dataclass
class _TenantBudget:
    requests: TokenBucket | None = None
    tokens: TokenBucket | None = None
    streams: int = 0

    def fit(self, limits: Limits) -> None:
        self.requests = _fit(self.requests, limits.requests_per_minute)
        self.tokens = _fit(self.tokens, limits.tokens_per_minute)


def _level(bucket: TokenBucket | None) -> float | None:
    return bucket.level if bucket is not None else None


def _fit(bucket: TokenBucket | None, capacity: float | None) -> TokenBucket | None:
    if capacity is None:
        return None
    if bucket is None:
        return TokenBucket(capacity, capacity)
    return bucket if bucket.capacity == capacity else bucket.resized(capacity)


class MemoryBudgets:
    """Budgets in this process: one router's."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._tenants: dict[str, _TenantBudget] = {}

    def _budget(self, tenant: str, limits: Limits) -> _TenantBudget:
        budget = self._tenants.setdefault(tenant, _TenantBudget())
        budget.fit(limits)
        return budget

    async def admit(self, tenant: str, limits: Limits, prompt_tokens: int) -> Admitted | Refusal:
        return self.admit_now(tenant, limits, prompt_tokens)

    def admit_now(self, tenant: str, limits: Limits, prompt_tokens: int) -> Admitted | Refusal:
        budget, now = self._budget(tenant, limits), self._clock()
        if limits.max_streams is not None and budget.streams >= limits.max_streams:
            return Refusal("streams", 1.0, f"{budget.streams} streams open")
        if budget.requests is not None and budget.requests.refill(now) < 1:
            return Refusal("requests", budget.requests.seconds_until(1, now))
        if budget.tokens is not None and budget.tokens.refill(now) < prompt_tokens:
            return Refusal("tokens", budget.tokens.seconds_until(prompt_tokens, now))
        if budget.requests is not None:
            budget.requests.level -= 1
        if budget.tokens is not None:
            budget.tokens.level -= prompt_tokens
        budget.streams += 1
        return Admitted(_level(budget.tokens), _level(budget.requests))

    async def charge(self, tenant: str, limits: Limits, tokens: int) -> float | None:
        return self.charge_now(tenant, limits, tokens)

    def charge_now(self, tenant: str, limits: Limits, tokens: int) -> float | None:
        budget = self._budget(tenant, limits)
        if budget.tokens is None:
            return None
        budget.tokens.refill(self._clock())
        budget.tokens.level -= tokens
        return budget.tokens.level

    async def cancel(self, tenant: str, limits: Limits, prompt_tokens: int) -> None:
        self.cancel_now(tenant, limits, prompt_tokens)

    def cancel_now(self, tenant: str, limits: Limits, prompt_tokens: int) -> None:
        budget, now = self._budget(tenant, limits), self._clock()
        for bucket, amount in ((budget.requests, 1), (budget.tokens, prompt_tokens)):
            if bucket is not None:
                bucket.level = min(bucket.capacity, bucket.refill(now) + amount)
        self.release_now(tenant)

    async def release(self, tenant: str, limits: Limits | None = None, tokens: int = 0) -> None:
        if limits is not None and tokens:
            self.charge_now(tenant, limits, tokens)
        self.release_now(tenant)

    def release_now(self, tenant: str) -> None:
        budget = self._tenants.get(tenant)
        if budget is not None and budget.streams > 0:
            budget.streams -= 1

"""The budgets a router charges: the shared ones (Redis) while they answer, else its own.

Redis unreachable or slow (no answer within ``timeout_s``): the router charges its own
memory instead, each limit cut to 1/N of itself, N the routers alive at the last
heartbeat that got through, so that the fleet still enforces about one limit; a metric
and a log line say so. The heartbeat finds Redis back, and shared budgets resume. A
request never fails because Redis did.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import replace

import redis.exceptions
from prometheus_client import Counter, Gauge

from services.router.shared.budgets import Admitted, Budgets, Limits, MemoryBudgets, Refusal

log = logging.getLogger(__name__)

DEGRADED = Gauge(
    "llm_router_shared_state_degraded", "1 while shared state (Redis) is out and limits are local"
)
FALLBACKS = Counter(
    "llm_router_shared_state_fallbacks_total", "Times shared state was found out of reach"
)
# What Redis trouble looks like from the client (timeouts included).
REDIS_ERRORS = (redis.exceptions.RedisError, OSError, TimeoutError)


class SharedHealth:
    """Whether shared state answers, as the last call or heartbeat found."""

    def __init__(self) -> None:
        self.up = True

    def down(self, error: BaseException) -> None:
        if self.up:
            self.up = False
            DEGRADED.set(1)
            FALLBACKS.inc()
            log.warning(
                "shared state out of reach: limits are this router's share, locally",
                extra={"fields": {"error": repr(error)}},
            )

    def back(self) -> None:
        if not self.up:
            self.up = True
            DEGRADED.set(0)
            log.info("shared state back")


class SharedBudgets:
    def __init__(
        self,
        local: MemoryBudgets,
        shared: Budgets | None = None,
        health: SharedHealth | None = None,
        fleet_size: Callable[[], int] = lambda: 1,
        *,
        charge_interval_s: float = 0.25,
        timeout_s: float = 0.25,
    ) -> None:
        self._local = local
        self._shared = shared
        self._health = health or SharedHealth()
        self._fleet_size = fleet_size
        self._interval = charge_interval_s
        self._timeout = timeout_s

    @classmethod
    def local(cls) -> SharedBudgets:
        """One router's budgets, in its memory."""
        return cls(MemoryBudgets())

    @property
    def charge_interval_s(self) -> float:
        return self._interval if self._shared is not None else 0.0

    def admit_now(
        self, tenant: str, limits: Limits, prompt_tokens: int
    ) -> tuple[Budgets, Admitted | Refusal] | None:
        """``admit``'s answer when this router's memory gives it (no shared store);
        None when it takes a round trip."""
        if self._shared is not None:
            return None
        return self._local, self._local.admit_now(tenant, limits, prompt_tokens)

    async def admit(
        self, tenant: str, limits: Limits, prompt_tokens: int
    ) -> tuple[Budgets, Admitted | Refusal]:
        """The outcome, and the store that gave it (where the stream is charged)."""
        if self._shared is not None and self._health.up:
            try:
                async with asyncio.timeout(self._timeout):
                    return self._shared, await self._shared.admit(tenant, limits, prompt_tokens)
            except REDIS_ERRORS as err:
                self._health.down(err)
        share = 1.0 / max(1, self._fleet_size()) if self._shared is not None else 1.0
        outcome = await self._local.admit(tenant, limits.scaled(share), prompt_tokens)
        return self._local, replace(outcome, share=share)

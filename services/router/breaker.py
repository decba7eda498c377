"""Per-replica circuit breaker: open after consecutive failures, then probe one request."""

from __future__ import annotations

import enum


class BreakerState(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"  # the cool-down passed; one probe request is let through


class CircuitBreaker:
    def __init__(self, failure_threshold: int = 3, open_s: float = 2.0) -> None:
        self._threshold = failure_threshold
        self._open_s = open_s
        self._failures = 0
        self._opened_at: float | None = None
        self._probing = False

    def state(self, now: float) -> BreakerState:
        if self._opened_at is None:
            return BreakerState.CLOSED
        if now - self._opened_at < self._open_s:
            return BreakerState.OPEN
        return BreakerState.HALF_OPEN

    def available(self, now: float) -> bool:
        """Whether a request may go to the replica now."""
        state = self.state(now)
        return state is BreakerState.CLOSED or (
            state is BreakerState.HALF_OPEN and not self._probing
        )

    def on_pick(self, now: float) -> None:
        if self.state(now) is BreakerState.HALF_OPEN:
            self._probing = True

    def on_success(self) -> None:
        self._failures, self._opened_at, self._probing = 0, None, False

    def on_failure(self, now: float) -> None:
        self._failures += 1
        if self._probing or self._failures >= self._threshold:
            self._opened_at, self._probing = now, False

    def on_abandon(self) -> None:
        """The request ended with no verdict on the replica (the client went away)."""
        self._probing = False

"""Per-replica circuit breaker: open after consecutive failures, then probe one request.

A probe that has had no verdict for another cool-down lets the next request probe too:
a request that never reports back must not keep the replica out for good."""

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
        self._probe_since: float | None = None  # when the probe in flight was sent

    def state(self, now: float) -> BreakerState:
        if self._opened_at is None:
            return BreakerState.CLOSED
        if now - self._opened_at < self._open_s:
            return BreakerState.OPEN
        return BreakerState.HALF_OPEN

    def available(self, now: float) -> bool:
        """Whether a request may go to the replica now."""
        state = self.state(now)
        if state is not BreakerState.HALF_OPEN:
            return state is BreakerState.CLOSED
        return self._probe_since is None or now - self._probe_since >= self._open_s

    def on_pick(self, now: float) -> None:
        if self.state(now) is BreakerState.HALF_OPEN:
            self._probe_since = now

    def on_success(self) -> None:
        self._failures, self._opened_at, self._probe_since = 0, None, None

    def on_failure(self, now: float) -> None:
        self._failures += 1
        if self._probe_since is not None or self._failures >= self._threshold:
            self._opened_at, self._probe_since = now, None

    def on_abandon(self) -> None:
        """The request ended with no verdict on the replica (the client went away)."""
        self._probe_since = None

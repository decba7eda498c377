"""Recent traffic: event rates over a sliding window, and how many slots a tier's traffic
is about to need: its arrival rate times how long a request holds a slot (Little's law),
plus room for the bursts of random arrivals."""

from __future__ import annotations

import math
from collections import deque

BURST_SIGMAS = 2.0  # Poisson arrivals: the mean number in flight plus two deviations


class RecentEvents:
    """The times of the events of the last ``window_s``."""

    def __init__(self, window_s: float) -> None:
        self._window_s = window_s
        self._times: deque[float] = deque()

    def add(self, now: float) -> None:
        self._times.append(now)
        self._forget(now)

    def rate(self, now: float) -> float:
        """Events per second over the window."""
        self._forget(now)
        return len(self._times) / self._window_s

    def _forget(self, now: float) -> None:
        while self._times and now - self._times[0] >= self._window_s:
            self._times.popleft()


class TierDemand:
    """Arrivals over the last ``window_s`` and a moving average of slot hold times."""

    def __init__(self, window_s: float, smoothing: float = 0.1) -> None:
        self._arrivals = RecentEvents(window_s)
        self._smoothing = smoothing
        self._hold_s: float | None = None

    def arrived(self, now: float) -> None:
        self._arrivals.add(now)

    def held(self, seconds: float) -> None:
        """A slot of this tier was released after ``seconds``."""
        if self._hold_s is None:
            self._hold_s = seconds
        else:
            self._hold_s += self._smoothing * (seconds - self._hold_s)

    def recent(self, now: float) -> bool:
        """Whether this tier had arrivals within the window."""
        return self._arrivals.rate(now) > 0

    def slots(self, now: float) -> float:
        """Slots this tier's traffic is expected to hold at once, bursts included."""
        rate = self._arrivals.rate(now)
        if self._hold_s is None or not rate:
            return 0.0
        mean = rate * self._hold_s
        return mean + BURST_SIGMAS * math.sqrt(mean)

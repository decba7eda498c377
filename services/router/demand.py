"""How many slots a tier's traffic is about to need: its arrival rate times how long a
request holds a slot (Little's law), plus room for the bursts of random arrivals."""

from __future__ import annotations

import math
from collections import deque

BURST_SIGMAS = 2.0  # Poisson arrivals: the mean number in flight plus two deviations


class TierDemand:
    """Arrivals over the last ``window_s`` and a moving average of slot hold times."""

    def __init__(self, window_s: float, smoothing: float = 0.1) -> None:
        self._window_s = window_s
        self._smoothing = smoothing
        self._arrivals: deque[float] = deque()
        self._hold_s: float | None = None

    def arrived(self, now: float) -> None:
        self._arrivals.append(now)
        self._forget(now)

    def held(self, seconds: float) -> None:
        """A slot of this tier was released after ``seconds``."""
        if self._hold_s is None:
            self._hold_s = seconds
        else:
            self._hold_s += self._smoothing * (seconds - self._hold_s)

    def slots(self, now: float) -> float:
        """Slots this tier's traffic is expected to hold at once, bursts included."""
        self._forget(now)
        if self._hold_s is None or not self._arrivals:
            return 0.0
        mean = len(self._arrivals) / self._window_s * self._hold_s
        return mean + BURST_SIGMAS * math.sqrt(mean)

    def _forget(self, now: float) -> None:
        while self._arrivals and now - self._arrivals[0] >= self._window_s:
            self._arrivals.popleft()

"""Stop strings on a text stream: holds back only what could still become a stop string."""

from __future__ import annotations


class StopMatcher:
    def __init__(self, stops: tuple[str, ...]) -> None:
        self._stops = stops
        self._pending = ""
        self.stopped = False

    def push(self, text: str) -> str:
        """Adds generated text; returns what is safe to release (never part of a stop)."""
        if not self._stops:
            return text
        self._pending += text
        cut = min((i for i in (self._pending.find(s) for s in self._stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            released, self._pending = self._pending[:cut], ""
            return released
        keep = self._held_suffix()
        released = self._pending[: len(self._pending) - keep]
        self._pending = self._pending[len(self._pending) - keep :]
        return released

    def flush(self) -> str:
        """At the end of the stream nothing more can match: release the rest."""
        released, self._pending = self._pending, ""
        return released

    def _held_suffix(self) -> int:
        """Length of the longest suffix of pending text that is a prefix of a stop string."""
        best = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(self._pending)), best, -1):
                if self._pending.endswith(stop[:n]):
                    best = n
                    break
        return best

"""Stop strings on a text stream: holds back only what could still become a stop string."""

from __future__ import annotations


class StopMatcher:
    def __init__(self, stops: tuple[str, ...], include: bool = False) -> None:
        self._stops = stops
        self._include = include  # vLLM's include_stop_str_in_output: the stop is released
        self._pending = ""
        # How much of the pending text came before matching began (a sequence's first
        # min_tokens): a stop string may begin there but must end after it (vLLM's rule).
        self._inert = 0
        self.stopped = False

    def push(self, text: str, matching: bool = True) -> str:
        """Adds generated text; returns what is safe to release (never part of a stop).
        Text pushed with ``matching`` false ends no stop string, yet what could begin one
        is held back all the same, so that a stop it begins is never shown."""
        if not self._stops:
            return text
        self._pending += text
        if not matching:
            self._inert = len(self._pending)
        cut, stop = self._first_stop()
        if cut >= 0:
            self.stopped = True
            end = cut + len(stop) if self._include else cut
            released, self._pending, self._inert = self._pending[:end], "", 0
            return released
        keep = self._held_suffix()
        released = self._pending[: len(self._pending) - keep]
        self._pending = self._pending[len(self._pending) - keep :]
        self._inert = max(0, self._inert - len(released))
        return released

    def flush(self) -> str:
        """At the end of the stream nothing more can match: release the rest."""
        released, self._pending, self._inert = self._pending, "", 0
        return released

    def _first_stop(self) -> tuple[int, str]:
        """Where the first stop string that ends past the inert text begins (-1: none),
        and which it is (the first listed of those that begin there)."""
        hits = ((self._pending.find(s, max(0, self._inert - len(s) + 1)), s) for s in self._stops)
        return min(((i, s) for i, s in hits if i >= 0), key=lambda hit: hit[0], default=(-1, ""))

    def _held_suffix(self) -> int:
        """Length of the longest suffix of pending text that is a prefix of a stop string."""
        best = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(self._pending)), best, -1):
                if self._pending.endswith(stop[:n]):
                    best = n
                    break
        return best

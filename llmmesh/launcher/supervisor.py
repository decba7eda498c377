"""Supervision of the local stack: a process that dies is started again, with backoff,
and awaited ready; one that keeps dying stops the stack, named.

What Kubernetes does for the Istio manifests (restartPolicy with its crash-loop backoff,
liveness and readiness probes) and the compose file's ``restart: unless-stopped``,
``llm-mesh up`` does here.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from llmmesh.launcher.process import StackError


@dataclass(frozen=True)
class RestartPolicy:
    first_backoff_s: float = 0.5  # doubled after each exit within the window
    max_backoff_s: float = 8.0
    max_restarts: int = 5  # restarts of one process within window_s; one more stops it all
    window_s: float = 120.0


def _sleep(seconds: float) -> bool:
    time.sleep(seconds)
    return False


class GaveUp(StackError):
    """A process kept dying: the stack stops."""


class Supervised(Protocol):
    """What the supervisor needs of the stack (llmmesh.launcher.Stack)."""

    def dead_children(self) -> list[str]: ...

    def exit_code(self, name: str) -> int | None: ...

    def restart(self, name: str, timeout_s: float = ...) -> None: ...

    def log_path(self, name: str) -> Path: ...


class Supervisor:
    """``tend()`` restarts every dead process of ``stack``. ``wait(s)`` sleeps a backoff
    and returns True if the stack is being stopped meanwhile (no restart then)."""

    def __init__(
        self,
        stack: Supervised,
        policy: RestartPolicy = RestartPolicy(),
        *,
        wait: Callable[[float], bool] = _sleep,
        clock: Callable[[], float] = time.monotonic,
        report: Callable[[str], None] = print,
    ) -> None:
        self._stack = stack
        self._policy = policy
        self._wait = wait
        self._clock = clock
        self._report = report
        self._exits: dict[str, collections.deque[float]] = collections.defaultdict(
            collections.deque
        )
        self.restarts: collections.Counter[str] = collections.Counter()

    def tend(self) -> bool:
        """Restarts what died, each awaited ready; True if anything was restarted.
        Raises GaveUp naming a process that exceeded its restart budget."""
        restarted = False
        for name in self._stack.dead_children():
            restarted |= self._revive(name)
        return restarted

    def _revive(self, name: str) -> bool:
        while True:
            delay = self._exited(name)
            code = self._stack.exit_code(name)
            self._report(f"{name} exited (code {code}); restarting in {delay:.1f} s")
            if self._wait(delay):
                return False
            try:
                self._stack.restart(name)
            except StackError as err:
                self._report(f"{name} did not come back: {str(err).splitlines()[0]}")
                continue
            self.restarts[name] += 1
            self._report(f"{name} restarted and ready")
            return True

    def _exited(self, name: str) -> float:
        """Counts one exit; the backoff before the restart, or GaveUp past the budget."""
        now, policy = self._clock(), self._policy
        exits = self._exits[name]
        exits.append(now)
        while exits and exits[0] < now - policy.window_s:
            exits.popleft()
        if len(exits) > policy.max_restarts:
            raise GaveUp(
                f"{name} exited {len(exits)} times within {policy.window_s:g} s; giving up"
                f" (see {self._stack.log_path(name)})"
            )
        backoff: float = policy.first_backoff_s * 2.0 ** (len(exits) - 1)
        return min(policy.max_backoff_s, backoff)

"""Waiting on a condition with a deadline (never a bare sleep)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable


def poll_until(
    condition: Callable[[], bool],
    timeout_s: float,
    interval_s: float = 0.05,
    give_up: Callable[[], None] | None = None,
) -> bool:
    """Calls ``condition`` until it returns True (exceptions count as False) or ``timeout_s``
    passes; ``give_up`` may raise to stop early. Returns whether the condition held."""
    deadline = time.monotonic() + timeout_s
    while True:
        if give_up is not None:
            give_up()
        with contextlib.suppress(Exception):
            if condition():
                return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval_s)


async def poll_until_async(
    condition: Callable[[], Awaitable[bool]], timeout_s: float, interval_s: float = 0.01
) -> bool:
    """``poll_until`` for a condition that must be awaited (in an event loop)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if await condition():
            return True
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(interval_s)  # the polling period

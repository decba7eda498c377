"""Work a first token waits on, counted per event loop, so that relays put it first.

One engine step brings a token for every running generation at once, and relaying them
keeps a router's event loop busy for milliseconds; a new request, or a first token,
that comes meanwhile waits behind all of them at each of its several loop turns (read,
admit and pick, write the start; read the first token, check it, write it). A later
token is one of many the client reads tens of milliseconds apart, and a millisecond
more of it goes unseen. So while any work of a first token's is pending, the relays
hold their later tokens back (``MultiplexCall``), for at most ``LATER_TOKENS_WAIT_S``.

Two kinds of work count: a request from its arrival until its start has gone upstream
(``pending_task``, ``request_pending``, ``start_sent``; not while it waits in a queue,
``waiting``), and a first token from its arrival until its generation has taken it (in
``MultiplexCall``).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import weakref
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, TypeVar

# How long the relays may hold a later token back while first tokens' work is pending:
# well under the gap between a stream's tokens, so that a client does not see it; and a
# bound, so that requests arriving all the time cannot hold later tokens back for good.
LATER_TOKENS_WAIT_S = 0.005

Release = Callable[[], None]
T = TypeVar("T")


class FirstTokenWork:
    """How many pieces of first tokens' work are pending on one event loop, and what
    runs once none is (each callback once, in the loop's next turn)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.pending = 0
        self._when_none: list[Callable[[], None]] = []

    def begin(self) -> Release:
        """One piece of work pending; the returned release ends it (idempotent)."""
        self.pending += 1
        released = False

        def release() -> None:
            nonlocal released
            if released:
                return
            released = True
            self.pending -= 1
            if not self.pending and self._when_none:
                callbacks, self._when_none = self._when_none, []
                for callback in callbacks:
                    # After the step that released: the first token's own next step
                    # (its write) is scheduled in it, and goes before what was held.
                    self._loop.call_soon(callback)

        return release

    def when_none(self, callback: Callable[[], None]) -> None:
        """``callback`` in the loop turn after the pending work has all ended."""
        self._when_none.append(callback)


_WORK: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, FirstTokenWork] = (
    weakref.WeakKeyDictionary()
)
# The release of the current request's work, for whoever sends its start.
_START: contextvars.ContextVar[Release | None] = contextvars.ContextVar(
    "first_token_start", default=None
)


def work() -> FirstTokenWork:
    """The running event loop's count."""
    loop = asyncio.get_running_loop()
    found = _WORK.get(loop)
    if found is None:
        found = _WORK[loop] = FirstTokenWork(loop)
    return found


def pending_task(coroutine: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
    """A task for a request that has just come: first tokens' work from now until its
    start has gone upstream (``start_sent``), or the task ends."""
    release = work().begin()
    context = contextvars.copy_context()
    context.run(_START.set, release)
    task = asyncio.get_running_loop().create_task(coroutine, context=context)
    task.add_done_callback(lambda _: release())
    return task


@contextlib.contextmanager
def request_pending() -> Iterator[None]:
    """The request handled in this block (in this task) is first tokens' work until its
    start has gone to the upstream (``start_sent``), or the block ends; it takes over
    from ``pending_task``'s count, if it runs in one."""
    inherited = _START.get()
    token = _START.set(work().begin())
    if inherited is not None:
        inherited()
    try:
        yield
    finally:
        release = _START.get()
        if release is not None:
            release()
        try:
            _START.reset(token)
        except ValueError:  # ended from another context (a generator finalized late)
            _START.set(None)


def start_sent() -> None:
    """The current request's start is on its way upstream (or its writer will write it
    before what this releases: the next loop turn); idempotent, and nothing outside
    ``request_pending``."""
    release = _START.get()
    if release is not None:
        release()


@contextlib.contextmanager
def waiting() -> Iterator[None]:
    """A wait of the current request's that may be long (a queue for admission): not
    first tokens' work while it lasts."""
    release = _START.get()
    if release is None:
        yield
        return
    release()
    try:
        yield
    finally:
        _START.set(work().begin())

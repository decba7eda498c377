"""CPU work too long for an event loop's turn, run on a thread beside it.

What a request costs the router grows with its text: a 60 KB conversation of numbers
takes 0.25-0.65 s to check against the rules and 0.1 s per count of its tokens. On the
loop's thread no other stream's token moves for that long; on another thread the loop
keeps its turns (the interpreter hands it over every few milliseconds, and a tokenizer
that lets go of it runs on the other core). A text up to ON_LOOP_CHARS stays on the loop:
the hand-off there and back costs about 0.1 ms, as much as such a text's work.
Work that holds the interpreter goes to one thread of its own, where owners (tenants) take
turns (TakingTurns); work that lets go of it, to asyncio's default pool.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

T = TypeVar("T")

ON_LOOP_CHARS = 4096


async def beside_loop_if_long(chars: int, work: Callable[[], T]) -> T:
    """``work`` on asyncio's default executor when its text is longer than ON_LOOP_CHARS
    (work that lets go of the interpreter, as a tokenizer's batch does), else here."""
    if chars <= ON_LOOP_CHARS:
        return work()
    return await asyncio.get_running_loop().run_in_executor(None, work)


class TakingTurns:
    """One thread whose work is run by owner in turn (a tenant's long checks): each
    owner's in the order it came, and next the owner with work waiting that was served
    least recently, so that one with many queued waits for its own work, never another's
    behind all of it.

    Used from one event loop at a time: jobs are queued and started on its thread, and a
    new loop (a test's next) starts with empty queues (the last one's are dead)."""

    REMEMBERED = 1024  # owners whose last turn is kept while they have nothing queued

    def __init__(self, name: str) -> None:
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queues: dict[str, deque[_Job[Any]]] = {}
        self._last_turn: dict[str, int] = {}
        self._turns = itertools.count()
        self._busy = False

    async def run(self, owner: str, work: Callable[[], T]) -> T:
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            self._loop, self._queues, self._busy = loop, {}, False
        job: _Job[T] = _Job(work, loop.create_future())
        self._queues.setdefault(owner, deque()).append(job)
        self._start_next()
        try:
            return await job.answer
        except asyncio.CancelledError:
            self._forget(owner, job)  # not started yet: its turn goes to the next
            raise

    def _start_next(self) -> None:
        if self._busy or not self._queues:
            return
        # Owners never served (or long idle) first, in the order they came.
        owner = min(self._queues, key=lambda o: self._last_turn.get(o, -1))
        jobs = self._queues[owner]
        job = jobs.popleft()
        if not jobs:
            del self._queues[owner]
        self._remember(owner)
        self._busy = True
        running = asyncio.get_running_loop().run_in_executor(self._thread, job.work)
        running.add_done_callback(functools.partial(self._finished, job))

    def _remember(self, owner: str) -> None:
        self._last_turn.pop(owner, None)  # the most recent last (a dict keeps its order)
        self._last_turn[owner] = next(self._turns)
        if len(self._last_turn) > self.REMEMBERED:
            idle = next((o for o in self._last_turn if o not in self._queues), None)
            if idle is not None:
                del self._last_turn[idle]  # the least recently served of those idle

    def _finished(self, job: _Job[Any], running: asyncio.Future[Any]) -> None:
        self._busy = False
        if not job.answer.done():  # else the caller left meanwhile
            _pass_on(running, job.answer)
        self._start_next()

    def _forget(self, owner: str, job: _Job[Any]) -> None:
        jobs = self._queues.get(owner)
        if jobs is not None and job in jobs:
            jobs.remove(job)
            if not jobs:
                del self._queues[owner]


def _pass_on(done: asyncio.Future[T], to: asyncio.Future[T]) -> None:
    """``done``'s outcome, as ``to``'s."""
    if done.cancelled():
        to.cancel()
    elif (error := done.exception()) is not None:
        to.set_exception(error)
    else:
        to.set_result(done.result())


@dataclass(eq=False)
class _Job(Generic[T]):
    work: Callable[[], T]
    answer: asyncio.Future[T]

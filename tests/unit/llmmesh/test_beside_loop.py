"""Work beside the event loop: owners take turns on one thread."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

import pytest

from llmmesh.runtime.beside_loop import TakingTurns


class Blocking:
    """A job that says when it runs and ends when told to."""

    def __init__(self, result: str = "") -> None:
        self.running, self.may_end = threading.Event(), threading.Event()
        self.result = result

    def __call__(self) -> str:
        self.running.set()
        self.may_end.wait(timeout=5)
        return self.result

    async def started(self) -> None:
        assert await asyncio.to_thread(self.running.wait, 5)


def recorded(ran: list[str], name: str) -> Callable[[], str]:
    def work() -> str:
        ran.append(name)
        return name.upper()

    return work


def test_owners_take_turns_and_each_owners_work_keeps_its_order() -> None:
    """One owner queues two more jobs while its first runs; another's job, queued after
    them, runs next, not behind the first owner's whole queue."""
    ran: list[str] = []
    first = Blocking("A1")

    async def scenario() -> list[str]:
        turns = TakingTurns("test-turns")
        running = asyncio.ensure_future(turns.run("a", first))
        await first.started()
        queued = [
            asyncio.ensure_future(turns.run(owner, recorded(ran, name)))
            for owner, name in (("a", "a2"), ("a", "a3"), ("b", "b1"))
        ]
        # A task's first step (which queues its job) comes before a callback asked later.
        asyncio.get_running_loop().call_soon(first.may_end.set)
        return list(await asyncio.gather(running, *queued))

    assert asyncio.run(scenario()) == ["A1", "A2", "A3", "B1"]
    assert ran == ["b1", "a2", "a3"]


def test_a_failure_is_its_callers_and_the_next_job_runs() -> None:
    def fails() -> str:
        raise ValueError("no")

    async def scenario() -> str:
        turns = TakingTurns("test-turns")
        failing = asyncio.ensure_future(turns.run("a", fails))
        after = asyncio.ensure_future(turns.run("a", lambda: "after"))
        with pytest.raises(ValueError, match="no"):
            await failing
        return await after

    assert asyncio.run(scenario()) == "after"


def test_a_caller_that_leaves_before_its_turn_gives_it_up() -> None:
    ran: list[str] = []
    first = Blocking()

    async def scenario() -> str:
        turns = TakingTurns("test-turns")
        running = asyncio.ensure_future(turns.run("a", first))
        await first.started()
        left = asyncio.ensure_future(turns.run("b", recorded(ran, "left")))
        loop = asyncio.get_running_loop()
        loop.call_soon(left.cancel)  # once its job is queued
        loop.call_soon(first.may_end.set)
        await running
        with pytest.raises(asyncio.CancelledError):
            await left
        return await turns.run("c", recorded(ran, "next"))

    assert asyncio.run(scenario()) == "NEXT"
    assert ran == ["next"]


def test_a_new_event_loop_starts_with_the_thread_free() -> None:
    """A loop closed while a job ran never heard it end (a test's loop): the next loop
    is not kept waiting for it."""
    turns = TakingTurns("test-turns")
    abandoned = Blocking()

    async def leaves_a_job_running() -> None:
        left = asyncio.ensure_future(turns.run("a", abandoned))
        await abandoned.started()
        assert not left.done()  # asyncio.run cancels it; the job runs on

    asyncio.run(leaves_a_job_running())
    abandoned.may_end.set()

    async def next_loop() -> str:
        return await asyncio.wait_for(turns.run("a", lambda: "ran"), timeout=5)

    assert asyncio.run(next_loop()) == "ran"


def test_owners_long_idle_are_forgotten_but_those_with_work_are_not() -> None:
    async def scenario() -> list[str]:
        turns = TakingTurns("test-turns")
        turns.REMEMBERED = 2
        for owner in ("a", "b", "c"):
            await turns.run(owner, lambda: None)
        return list(turns._last_turn)

    assert asyncio.run(scenario()) == ["b", "c"]

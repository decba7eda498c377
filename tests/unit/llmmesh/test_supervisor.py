"""The supervisor restarts what dies, with doubling backoff, and gives up on a process
that keeps dying, naming it; against a stack double and a fake clock."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest

from llmmesh.launcher.process import StackError
from llmmesh.launcher.supervisor import GaveUp, RestartPolicy, Supervisor


@dataclass
class StackDouble:
    dead: set[str] = field(default_factory=set)
    fail_restarts: int = 0  # the next restarts that die while starting
    restarted: list[str] = field(default_factory=list)

    def dead_children(self) -> list[str]:
        return sorted(self.dead)

    def exit_code(self, name: str) -> int | None:
        return -9 if name in self.dead else None

    def restart(self, name: str, timeout_s: float = 180.0) -> None:
        if self.fail_restarts:
            self.fail_restarts -= 1
            raise StackError(f"{name} exited with code 1:\nboom")
        self.dead.discard(name)
        self.restarted.append(name)

    def log_path(self, name: str) -> Path:
        return Path("logs") / f"{name}.log"


@dataclass
class Clock:
    now: float = 0.0
    waits: list[float] = field(default_factory=list)

    def wait(self, seconds: float) -> bool:
        self.waits.append(seconds)
        self.now += seconds
        return False


def supervisor(stack: StackDouble, clock: Clock, **policy: float) -> Supervisor:
    return Supervisor(
        stack,
        RestartPolicy(**policy),  # type: ignore[arg-type]
        wait=clock.wait,
        clock=lambda: clock.now,
        report=lambda line: None,
    )


def test_a_dead_process_is_restarted_and_nothing_else_is() -> None:
    stack, clock = StackDouble(dead={"policy"}), Clock()
    tending = supervisor(stack, clock)
    assert tending.tend()
    assert stack.restarted == ["policy"] and clock.waits == [0.5]
    assert not tending.tend()  # nothing dead: nothing done
    assert tending.restarts == {"policy": 1}


def test_backoff_doubles_while_a_process_keeps_dying_and_a_failed_start_counts() -> None:
    stack, clock = StackDouble(dead={"router"}, fail_restarts=2), Clock()
    tending = supervisor(stack, clock, max_backoff_s=1.5)
    tending.tend()
    assert clock.waits == [0.5, 1.0, 1.5]  # two starts that died, then one that held
    assert stack.restarted == ["router"]


def test_a_process_past_its_budget_stops_the_stack_named() -> None:
    stack, clock = StackDouble(dead={"context"}, fail_restarts=10), Clock()
    tending = supervisor(stack, clock, max_restarts=3, window_s=60)
    with pytest.raises(GaveUp, match=r"context exited 4 times within 60 s.*context\.log"):
        tending.tend()


def test_exits_long_ago_leave_the_budget() -> None:
    stack, clock = StackDouble(), Clock()
    tending = supervisor(stack, clock, max_restarts=1, window_s=10)
    for _ in range(3):  # one death every 20 s: never two within the window
        stack.dead.add("inference")
        tending.tend()
        clock.now += 20
    assert stack.restarted == ["inference"] * 3
    assert clock.waits == [0.5, 0.5, 0.5]


def test_a_stop_during_the_backoff_restarts_nothing() -> None:
    stack = StackDouble(dead={"policy"})
    tending = Supervisor(stack, wait=lambda s: True, report=lambda line: None)
    assert not tending.tend()
    assert stack.restarted == []

"""kill -9 of each process type under conversational load, the stack supervised as
`llm-mesh up` supervises it, its sessions in Redis (`--context-store redis`); the figures
go to bench/results/chaos.json and docs/reliability.md.

Per kill: how long until requests succeed again, what the requests in flight saw
(refused before streaming, or cut mid-stream with a status; none may hang), and whether
every acknowledged turn is in its session afterwards.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from llmmesh.client import internal_channel
from llmmesh.launcher import Stack, StackPorts
from llmmesh.launcher.stack import DEFAULT_ROUTING
from llmmesh.launcher.supervisor import Supervisor
from llmmesh.v1 import context_pb2, context_pb2_grpc
from tests.chaos.load import Load, Outcome
from tests.conftest import backend_pids, wait_for

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results" / "chaos.json"
# The canary serves the model too: with it as stable's fallback, requests that had not
# started streaming when stable's replica died are served there.
ROUTING = DEFAULT_ROUTING + "fallback: {stable: [canary]}\n"
KILLS = ["router", "policy", "context", "redis", "inference", "triton", "model stub"]
SETTLED_ACKS = 12  # acknowledged requests after recovery before the load stops
STALL_S = 15.0  # the inference service's default stall time


class Supervised:
    """A stack and its supervisor, tending it from a thread of its own."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.lines: list[str] = []
        self._stop = threading.Event()
        self.supervisor = Supervisor(stack, wait=self._stop.wait, report=self.lines.append)
        self._thread = threading.Thread(target=self._tend, daemon=True)

    def _tend(self) -> None:
        while not self._stop.wait(0.2):  # the supervision period, as `llm-mesh up`'s
            self.supervisor.tend()

    def __enter__(self) -> Supervised:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(60)


@pytest.fixture(scope="module")
def supervised(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Supervised]:
    workdir = tmp_path_factory.mktemp("chaos")
    (workdir / "routing.yaml").write_text(ROUTING)
    # Sessions in the stack's own Redis (appendfsync always), so that Redis is killed too.
    stack = Stack(workdir, StackPorts.free(), context_store="redis")
    with stack, Supervised(stack) as tended:
        yield tended


@pytest.fixture(scope="module")
def results() -> Iterator[dict[str, Any]]:
    found: dict[str, Any] = {}
    yield found
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(found, indent=2) + "\n")


def model_stub(stack: Stack) -> int:
    """The pid of the ``llm`` model's backend process, once there is one (a reload may be
    starting a new one)."""
    wait_for(lambda: "llm_0_0" in backend_pids(stack), 60, "the llm model's backend process")
    return backend_pids(stack)["llm_0_0"]


def stored_request_ids(stack: Stack, sessions: set[str]) -> set[str]:
    with internal_channel(stack.address("context"), stack.internal_token) as channel:
        stub = context_pb2_grpc.ContextStub(channel)
        found: set[str] = set()
        for session in sessions:
            reply = stub.LoadSession(
                context_pb2.LoadSessionRequest(tenant="demo", session_id=session), timeout=10
            )
            found |= {turn.request_id for turn in reply.turns}
        return found


def summary(outcomes: list[Outcome], killed_at: float) -> dict[str, Any]:
    """What the requests that ended after the kill saw: those in flight at the kill
    (waiting for their first token, or streaming), and those sent after it."""
    at_kill = [o for o in outcomes if o.started_at <= killed_at]
    waiting = [o for o in at_kill if o.first_token_at is None or o.first_token_at > killed_at]
    streaming = [o for o in at_kill if o not in waiting]
    later = [o for o in outcomes if o.started_at > killed_at]
    failed = [o for o in outcomes if not o.acknowledged]
    served_later = [o.ended_at for o in later if o.acknowledged]
    return {
        "requests": len(outcomes),
        "waiting_at_kill": len(waiting),
        "waiting_failed": sum(not o.acknowledged for o in waiting),
        "streaming_at_kill": len(streaming),
        "streaming_cut": sum(not o.acknowledged for o in streaming),
        "sent_after": len(later),
        "sent_after_failed": sum(not o.acknowledged for o in later),
        "hung": sum(o.code == "DEADLINE_EXCEEDED" for o in failed),
        # The first request sent after the kill that was answered whole, and the last of
        # those in flight at the kill to end (answered, resumed, or refused).
        "serving_again_after_s": round(min(served_later, default=killed_at) - killed_at, 2),
        "in_flight_ended_after_s": round(
            max((o.ended_at for o in at_kill), default=killed_at) - killed_at, 2
        ),
        "statuses": sorted({f"{o.code}: {o.detail}" for o in failed}),
    }


@pytest.mark.parametrize("name", KILLS)
def test_kill_9_under_load(supervised: Supervised, results: dict[str, Any], name: str) -> None:
    stack = supervised.stack
    load = Load(stack.address("router"), stack.api_key)
    load.start()
    try:
        wait_for(lambda: sum(o.acknowledged for o in load.outcomes) >= 8, 60, "warm load")
        pid = model_stub(stack) if name == "model stub" else stack.pids()[name]
        killed_at = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        wait_for(
            lambda: (
                sum(o.acknowledged and o.started_at > killed_at for o in load.outcomes)
                >= SETTLED_ACKS
            ),
            120,
            f"serving again after {name} was killed",
        )
    finally:
        load.stop()
    after = load.after(killed_at)
    figures = summary(after, killed_at)
    acknowledged = {o.request_id for o in load.outcomes if o.acknowledged}
    sessions = {o.session for o in load.outcomes}
    figures["acknowledged_turns"] = len(acknowledged)
    figures["lost_turns"] = len(acknowledged - stored_request_ids(stack, sessions))
    results[name] = figures
    # The invariants; the times are compared with their goal in docs/reliability.md.
    assert figures["lost_turns"] == 0, figures
    assert figures["hung"] == 0, figures
    assert figures["in_flight_ended_after_s"] <= STALL_S + 5, figures

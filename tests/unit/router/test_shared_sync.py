"""What one router learns of the others (services/router/shared/sync.py), without Redis:
their streams per replica, counted until they go quiet, and their picks."""

from __future__ import annotations

import asyncio
from typing import Any

from llmmesh.waiting import poll_until_async
from services.router.config import PoolSettings
from services.router.endpoints import Endpoint, FixedDiscovery
from services.router.replicas import ReplicaSet
from services.router.scheduling import SchedulingState
from services.router.scheduling.types import Picked
from services.router.shared.resilient import SharedHealth
from services.router.shared.sync import PeerStreams, SchedulingSync
from tests.replicas_double import MemoryConnector


def test_peers_streams_add_up_until_a_router_goes_quiet() -> None:
    now = [100.0]
    peers = PeerStreams(stale_after_s=3.0, clock=lambda: now[0])
    peers.heard("b", {"x:1": 2, "y:1": 1})
    peers.heard("c", {"x:1": 3})
    assert (peers.in_flight("x:1"), peers.in_flight("y:1"), peers.in_flight("z:1")) == (5, 1, 0)
    now[0] += 2.0
    peers.heard("c", {"x:1": 1})  # c reports again; b stays silent
    now[0] += 1.5
    assert peers.in_flight("x:1") == 1 and peers.in_flight("y:1") == 0


def test_a_replicas_candidate_counts_every_routers_streams() -> None:
    async def scenario() -> tuple[int, int]:
        peers = PeerStreams(stale_after_s=3.0)
        peers.heard("b", {"x:1": 4})
        replicas = ReplicaSet(
            FixedDiscovery(("x:1",)), MemoryConnector(), PoolSettings(), "local", peers=peers
        )
        replicas.apply([Endpoint(address="x:1")])  # its load follower starts in the loop
        [candidate] = replicas.candidates("llm")
        await replicas.close()
        return candidate.in_flight, candidate.unseen

    assert asyncio.run(scenario()) == (4, 4)  # in no report yet: all unseen


def test_the_other_routers_picks_are_learned_and_its_own_ignored() -> None:
    client: Any = None  # no message goes out in this test
    sync = SchedulingSync(client, "p:", "a", PeerStreams(3.0), SharedHealth())
    state = SchedulingState("local")
    sync.attach(state, dict)
    sync._apply(
        {"router": "b", "in_flight": {"x:1": 1}, "picks": [["x:1", "canary", "t/s", [7, 8]]]}
    )
    sync._apply({"router": "a", "in_flight": {}, "picks": [["y:1", "stable", "t/u", [9]]]})
    assert state.sessions.get("t/s") == "x:1" and state.sessions.subset("t/s") == "canary"
    assert state.prefixes.matched_blocks([7, 8]) == {"x:1": 2}
    assert state.sessions.get("t/u") is None  # its own message
    assert sync.peers.in_flight("x:1") == 1


class RecordingRedis:
    """Records what a pipeline writes (the part of redis.asyncio.Redis the homes use)."""

    def __init__(self) -> None:
        self.written: list[tuple[str, str, int]] = []

    def pipeline(self, transaction: bool = True) -> RecordingRedis:
        return self

    def set(self, key: str, value: str, ex: int) -> None:
        self.written.append((key, value, ex))

    async def execute(self) -> list[bool]:
        return [True] * len(self.written)


def test_a_sessions_home_is_written_at_once_not_with_the_next_batch() -> None:
    """The next turn may reach another router as soon as this one ends: the home goes
    out on the pick, whether or not the batching loop runs."""

    async def scenario() -> list[tuple[str, str, int]]:
        client = RecordingRedis()
        sync = SchedulingSync(client, "p:", "a", PeerStreams(3.0), SharedHealth(), interval_s=60)  # type: ignore[arg-type]
        sync.picked(Picked("x:1", "stable", "t/s"))
        sync.picked(Picked("y:1", "stable"))  # no session: nothing to write

        async def written() -> bool:
            return bool(client.written)

        assert await poll_until_async(written, 5)
        return client.written

    assert asyncio.run(scenario()) == [("p:session:t/s", '["x:1", "stable"]', 3600)]

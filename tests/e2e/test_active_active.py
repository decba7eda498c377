"""Two routers over one fleet (`llm-mesh up --routers 2`: their state shared through the
stack's Redis, an Envoy front on the router's ports): a tenant's limits hold as one, a
conversation whose turns alternate between the routers stays on one replica and one
version, Redis going away fails no request, and a router killed under load loses no
request that had not reached it."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc
import pytest

from llmmesh.client import authorized_channel, build_request
from llmmesh.launcher import Stack, StackPorts
from llmmesh.launcher.process import Child
from llmmesh.v1 import common_pb2, generation_pb2_grpc
from services.router.tenants import hash_key
from tests.conftest import collect, metric_value, start_service, wait_for

TENANTS: dict[str, dict[str, object]] = {
    "pair": {"max_concurrent_streams": 2},
    "frugal": {"tokens_per_minute": 600, "on_budget_exhausted": "finish"},
    "steady": {},
}


@dataclass
class Fleet:
    stack: Stack
    keys: dict[str, str]
    extra: Child  # a second stable replica

    @property
    def routers(self) -> list[str]:
        return [self.stack.endpoints()[f"router_{n}"] for n in (1, 2)]

    def metrics(self, n: int) -> str:
        return f"http://{self.stack.endpoints()[f'router_{n}_metrics']}/metrics"


def _write_fleet_documents(stack: Stack, extra: str) -> dict[str, str]:
    """The test's tenants beside the stack's demo one; a second stable replica; a canary
    at half the weight (a conversation has a replica and a version to keep)."""
    keys = {name: uuid.uuid4().hex for name in TENANTS}
    tenants = [
        {"id": name, **spec, "api_key_hashes": [hash_key(keys[name])]}
        for name, spec in TENANTS.items()
    ]
    demo = {"id": "demo", "api_key_hashes": [hash_key(stack.api_key)]}
    doc = {"tenants": [*tenants, demo]}
    stack.tenants_file.write_text(json.dumps(doc))
    endpoints = json.loads(stack.endpoints_file.read_text())
    endpoints["endpoints"].append({"address": extra, "version": "stable", "region": "local"})
    stack.endpoints_file.write_text(json.dumps(endpoints))
    stack.routing_file.write_text("split: {stable: 50, canary: 50}\n")
    return keys


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    tmp = tmp_path_factory.mktemp("active-active")
    with Stack(tmp / "stack", StackPorts.free(), routers=2) as stack:
        port = StackPorts.free().inference
        extra = start_service(stack, "inference", port, tmp)
        try:
            keys = _write_fleet_documents(stack, f"127.0.0.1:{port}")
            shared = Fleet(stack, keys, extra)

            def applied() -> bool:  # both know the tenants (files are watched) and each other
                for n in (1, 2):
                    url = shared.metrics(n)
                    if metric_value(url, "llm_router_fleet_routers", {}) != 2:
                        return False
                    if metric_value(url, "llm_router_shared_state_degraded", {}) != 0:
                        return False
                for address in shared.routers:
                    try:
                        with authorized_channel(address, keys["steady"]) as channel:
                            collect(channel, "hi", max_tokens=1, timeout_s=10)
                    except grpc.RpcError:
                        return False
                return True

            wait_for(applied, 30, "the routers to apply the test's documents")
            yield shared
        finally:
            extra.terminate(5)


def test_concurrent_streams_are_capped_across_both_routers(fleet: Fleet) -> None:
    """Two streams open, one through each router: a third is refused by either, where
    two routers keeping their own counts would let two more in."""
    key, held = fleet.keys["pair"], []
    for address in fleet.routers:
        channel = authorized_channel(address, key)
        stream = generation_pb2_grpc.GenerationStub(channel).Generate(
            build_request("hold", max_tokens=1000, ignore_eos=True)
        )
        next(stream)  # streaming now
        held.append((channel, stream))
    try:
        for address in fleet.routers:
            with authorized_channel(address, key) as channel, pytest.raises(grpc.RpcError) as err:
                collect(channel, "a third", max_tokens=1)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "2 streams open" in (err.value.details() or "")
    finally:
        for channel, stream in held:
            stream.cancel()
            channel.close()


def test_a_token_budget_is_spent_once_across_both_routers(fleet: Fleet) -> None:
    """Requests alternate between the routers until the budget runs out: what they spent
    in all is the budget, give or take one charge interval's tokens, not twice it."""
    spent, n = 0, 0
    while n < 40:
        address = fleet.routers[n % 2]
        n += 1
        try:
            with authorized_channel(address, fleet.keys["frugal"]) as channel:
                last = collect(channel, f"spend {n}", max_tokens=64, ignore_eos=True)[-1]
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            break
        spent += last.usage.prompt_tokens + last.usage.completion_tokens
        if last.finish_reason == common_pb2.FINISH_REASON_BUDGET:
            break
    # The bucket refills 10 tokens a second meanwhile; a stream runs on for at most one
    # charge interval (0.25 s) past the budget before its router hears so.
    assert 600 <= spent <= 600 * 1.3, spent


def test_a_conversation_alternating_between_routers_keeps_its_replica_and_version(
    fleet: Fleet,
) -> None:
    session = f"alt-{uuid.uuid4().hex[:6]}"
    served = []
    for turn in range(6):
        address = fleet.routers[turn % 2]
        with authorized_channel(address, fleet.keys["steady"]) as channel:
            last = collect(channel, f"turn {turn}", max_tokens=4, session_id=session)[-1]
        served.append((last.served.endpoint, last.served.subset))
    assert len(set(served)) == 1, served


@dataclass
class Load:
    """Requests one after another on each of ``threads`` threads until stopped; when each
    started and how it ended."""

    address: str
    key: str
    threads: int = 2
    max_tokens: int = 4
    outcomes: list[tuple[float, str]] = field(default_factory=list)  # (started, "ok"|error)
    _stop: threading.Event = field(default_factory=threading.Event)
    _workers: list[threading.Thread] = field(default_factory=list)

    def __enter__(self) -> Load:
        self._workers = [
            threading.Thread(target=self._run, daemon=True) for _ in range(self.threads)
        ]
        for worker in self._workers:
            worker.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        for worker in self._workers:
            worker.join(30)

    def answered(self) -> int:
        return sum(1 for _, outcome in self.outcomes if outcome == "ok")

    def _run(self) -> None:
        with authorized_channel(self.address, self.key) as channel:
            while not self._stop.is_set():
                started = time.monotonic()
                try:
                    collect(channel, "keep going", max_tokens=self.max_tokens, timeout_s=30)
                    self.outcomes.append((started, "ok"))
                except grpc.RpcError as err:
                    self.outcomes.append((started, f"{err.code().name}: {err.details()}"))


def test_redis_going_away_fails_no_request_and_sharing_resumes(fleet: Fleet) -> None:
    name = "llm_router_shared_state_degraded"

    def degraded(value: float) -> bool:
        return all(metric_value(fleet.metrics(n), name, {}) == value for n in (1, 2))

    loads = [Load(address, fleet.keys["steady"], threads=1) for address in fleet.routers]
    with loads[0], loads[1]:
        wait_for(lambda: min(load.answered() for load in loads) >= 2, 30, "load on both")
        os.killpg(fleet.stack.pids()["redis"], signal.SIGKILL)  # gone, mid-load
        wait_for(lambda: degraded(1), 10, "both routers to fall back")
        before = [load.answered() for load in loads]
        wait_for(
            lambda: all(load.answered() >= b + 4 for load, b in zip(loads, before, strict=True)),
            30,
            "requests answered without Redis",
        )
        fleet.stack.restart("redis")  # back, with its append-only file
        wait_for(lambda: degraded(0), 10, "both routers back on shared state")
    assert [o for load in loads for _, o in load.outcomes if o != "ok"] == []


def test_a_router_killed_under_load_loses_no_request_that_had_not_reached_it(
    fleet: Fleet,
) -> None:
    front = fleet.stack.address("router")
    fleets = "llm_router_fleet_routers"
    assert metric_value(fleet.metrics(2), fleets, {}) == 2
    limit_before = metric_value(fleet.metrics(2), "llm_router_concurrency_limit", {})
    with Load(front, fleet.keys["steady"], threads=4, max_tokens=16) as load:
        wait_for(lambda: load.answered() >= 8, 30, "load through the front")
        os.killpg(fleet.stack.pids()["router-1"], signal.SIGKILL)
        killed_at = time.monotonic()
        # The survivor sees it gone within the heartbeat TTL (3 s) and one beat (1 s),
        # and takes the whole window.
        wait_for(lambda: metric_value(fleet.metrics(2), fleets, {}) == 1, 5, "one router left")
        took_over = time.monotonic() - killed_at
        answered = load.answered()
        wait_for(lambda: load.answered() >= answered + 16, 30, "load on the survivor")
    limit_after = metric_value(fleet.metrics(2), "llm_router_concurrency_limit", {})
    fleet.stack.restart("router-1")
    after_kill = [o for started, o in load.outcomes if started > killed_at]
    assert after_kill and set(after_kill) == {"ok"}, after_kill
    # Streams it was relaying (their first token sent) end with an error saying so: Envoy
    # resets a stream whose router dies after answering, which gRPC reads as INTERNAL.
    cut = [o for started, o in load.outcomes if started <= killed_at and o != "ok"]
    assert all(o.startswith(("UNAVAILABLE: ", "INTERNAL: Stream removed")) for o in cut), cut
    assert took_over <= 5 and limit_after == pytest.approx(2 * limit_before, rel=0.2)


def test_the_front_serves_the_http_api_too(fleet: Fleet) -> None:
    request = urllib.request.Request(
        f"http://{fleet.stack.address('router_http')}/v1/models",
        headers={"Authorization": f"Bearer {fleet.keys['steady']}"},
    )
    with urllib.request.urlopen(request, timeout=10) as reply:
        models = json.loads(reply.read())
    assert "llm" in {m["id"] for m in models["data"]}

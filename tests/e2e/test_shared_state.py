"""Routers' shared state on a real Redis: budgets charged atomically by several routers,
the streams of a router that died no longer counted, the fleet's size from heartbeats,
and the fall back to each router's share of a limit while Redis is out of reach."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import pytest
import redis.asyncio as redis

from llmmesh.launcher import StackPorts
from llmmesh.waiting import poll_until_async
from services.router.shared.allowances import AllowanceBudgets
from services.router.shared.budgets import Admitted, Limits, MemoryBudgets, Refusal
from services.router.shared.fleet import Fleet
from services.router.shared.redis_budgets import RedisBudgets
from services.router.shared.resilient import SharedBudgets, SharedHealth
from tests.conftest import RedisServer


def run(scenario: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(scenario())


def routers(url: str, *names: str, ttl_s: float = 3.0) -> tuple[str, list[RedisBudgets], Any]:
    """Budgets of several routers over one Redis, under a prefix of the test's own."""
    prefix = f"test-{uuid.uuid4().hex[:8]}:"
    client = redis.Redis.from_url(url)
    return prefix, [RedisBudgets(client, prefix, name, ttl_s) for name in names], client


async def beat(client: Any, prefix: str, *names: str) -> None:
    for name in names:
        await Fleet(client, f"{prefix}routers", name, SharedHealth()).beat()


def test_two_routers_hold_one_request_budget_and_one_stream_cap(
    redis_server: RedisServer,
) -> None:
    async def scenario() -> None:
        prefix, (a, b), client = routers(redis_server.url, "a", "b")
        await beat(client, prefix, "a", "b")
        per_minute = Limits(requests_per_minute=4)
        outcomes = [await r.admit("t", per_minute, 1) for r in (a, b, a, b, a)]
        assert [isinstance(o, Admitted) for o in outcomes] == [True] * 4 + [False]
        left = [o.requests_left for o in outcomes if isinstance(o, Admitted)]
        assert left == pytest.approx([3, 2, 1, 0], abs=0.1)  # whichever router admitted
        refused = outcomes[-1]
        assert isinstance(refused, Refusal) and refused.limit == "requests"
        assert 10 < refused.retry_after_s <= 15  # a request refills every 15 s
        streams = Limits(max_streams=2)
        assert isinstance(await a.admit("u", streams, 1), Admitted)
        assert isinstance(await b.admit("u", streams, 1), Admitted)
        over = await a.admit("u", streams, 1)
        assert isinstance(over, Refusal) and over.limit == "streams"
        await b.release("u")
        assert isinstance(await a.admit("u", streams, 1), Admitted)
        await client.aclose()

    run(scenario)


def test_tokens_charged_by_either_router_come_off_one_bucket(redis_server: RedisServer) -> None:
    async def scenario() -> None:
        _, (a, b), client = routers(redis_server.url, "a", "b")
        budget = Limits(tokens_per_minute=1000)
        first = await a.admit("t", budget, 300)
        assert isinstance(first, Admitted) and first.tokens_left == pytest.approx(700, abs=1)
        left = await b.charge("t", budget, 500)
        assert left == pytest.approx(200, abs=1)
        refused = await b.admit("t", budget, 300)
        assert isinstance(refused, Refusal) and refused.limit == "tokens"
        await client.aclose()

    run(scenario)


def test_a_dead_routers_streams_stop_counting(redis_server: RedisServer) -> None:
    async def scenario() -> None:
        prefix, (a, b), client = routers(redis_server.url, "a", "b", ttl_s=1.0)
        await beat(client, prefix, "a", "b")
        one = Limits(max_streams=1)
        assert isinstance(await b.admit("t", one, 1), Admitted)
        assert isinstance(await a.admit("t", one, 1), Refusal)  # b's stream counts
        await client.zrem(f"{prefix}routers", "b")  # b died: its heartbeat is gone
        assert isinstance(await a.admit("t", one, 1), Admitted)
        await client.aclose()

    run(scenario)


def test_the_fleet_counts_routers_by_their_heartbeats(redis_server: RedisServer) -> None:
    async def scenario() -> None:
        client = redis.Redis.from_url(redis_server.url)
        key, sizes = f"test-{uuid.uuid4().hex[:8]}:routers", list[int]()
        a = Fleet(client, key, "a", SharedHealth(), ttl_s=0.5, on_size=sizes.append)
        b = Fleet(client, key, "b", SharedHealth(), ttl_s=0.5)
        await a.beat()
        await b.beat()
        await a.beat()
        assert a.size == 2
        await b.leave()
        await a.beat()
        assert a.size == 1 and sizes == [2, 1]
        await client.aclose()

    run(scenario)


def test_with_redis_out_of_reach_each_router_takes_its_share_and_comes_back(
    redis_server: RedisServer,
) -> None:
    async def scenario() -> None:
        closed = f"redis://127.0.0.1:{StackPorts.free().redis}/0"  # nothing listens there
        down = redis.Redis.from_url(closed, socket_timeout=0.2, socket_connect_timeout=0.2)
        health = SharedHealth()

        def shared_up() -> bool:  # read after each step (an attribute would stay narrowed)
            return health.up

        shared = RedisBudgets(down, "test:", "a", 3.0)
        budgets = SharedBudgets(MemoryBudgets(), shared, health, lambda: 2, timeout_s=0.2)
        limits = Limits(requests_per_minute=10)
        admitted = [(await budgets.admit("t", limits, 1)) for _ in range(6)]
        assert not shared_up()
        stores = {store for store, _ in admitted}
        assert len(stores) == 1 and isinstance(stores.pop(), MemoryBudgets)
        outcomes = [isinstance(outcome, Admitted) for _, outcome in admitted]
        assert outcomes == [True] * 5 + [False]  # 10 a minute, 1/2 of it here
        fleet = Fleet(redis.Redis.from_url(redis_server.url), "test:r", "a", health)
        await fleet.beat()  # Redis answers again: shared budgets resume
        assert shared_up()
        await down.aclose()

    run(scenario)


async def poll_redis(
    read: Callable[[], Awaitable[Any]], done: Callable[[Any], bool], timeout_s: float = 10.0
) -> bool:
    """Whether what ``read`` returns satisfies ``done`` within ``timeout_s`` (read every
    50 ms: Redis has no way to announce a hash field's change)."""

    async def holds() -> bool:
        return done(await read())

    return await poll_until_async(holds, timeout_s, interval_s=0.05)


async def script_calls(client: Any) -> int:
    stats = await client.info("commandstats")
    return sum(
        int(v["calls"]) for k, v in stats.items() if k in ("cmdstat_evalsha", "cmdstat_eval")
    )


def test_allowances_admit_without_a_round_trip_and_never_past_the_bucket(
    redis_server: RedisServer,
) -> None:
    """Two routers spending allowances of one bucket of 60 requests a minute: together they
    admit what the bucket holds (plus what refills meanwhile), no more, and most of their
    admissions ask Redis nothing."""

    async def scenario() -> None:
        _, (a, b), client = routers(redis_server.url, "a", "b")
        one, two = AllowanceBudgets(a, 5.0, 60.0), AllowanceBudgets(b, 5.0, 60.0)
        limits = Limits(requests_per_minute=60, tokens_per_minute=60_000)
        before = await script_calls(client)
        outcomes = [await r.admit("t", limits, 10) for _ in range(20) for r in (one, two)]
        assert all(isinstance(o, Admitted) for o in outcomes)
        # The bucket's requests as of each router's last grant, with what it holds: 20
        # left of 60 after 40 (and what refilled meanwhile), less at most what the other
        # router holds (5 s of the rate, topped up at half).
        first, last = outcomes[0], outcomes[-1]
        assert isinstance(first, Admitted) and isinstance(last, Admitted)
        assert first.requests_left == pytest.approx(59, abs=1)
        assert last.requests_left is not None and 20 - 10 <= last.requests_left <= 20 + 2
        calls = await script_calls(client) - before
        assert calls <= len(outcomes) / 3, f"{calls} round trips for {len(outcomes)} admissions"
        for _ in range(30):
            outcomes += [await r.admit("t", limits, 10) for r in (one, two)]
        admitted = sum(isinstance(o, Admitted) for o in outcomes)
        assert 60 <= admitted <= 62  # a request refills every second
        await client.aclose()

    run(scenario)


def test_an_idle_allowance_goes_back_to_the_bucket_and_overspent_tokens_are_charged(
    redis_server: RedisServer,
) -> None:
    async def scenario() -> None:
        prefix, (a,), client = routers(redis_server.url, "a")
        budgets = AllowanceBudgets(a, 6.0, 0.2)
        limits = Limits(tokens_per_minute=6000)  # 100 a second: 600 held ahead
        first = await budgets.admit("t", limits, 100)
        assert isinstance(first, Admitted) and first.tokens_left == pytest.approx(5900, abs=5)
        key = f"{prefix}budget:t"
        assert float(await client.hget(key, "t:l")) == pytest.approx(5300, abs=5)
        left = await budgets.charge("t", limits, 1000)  # 400 past its allowance
        assert left == pytest.approx(4900, abs=10)  # charged to the bucket at once
        await budgets.admit("t", limits, 1)  # takes an allowance again
        giving_back = asyncio.create_task(budgets.run())
        assert await poll_redis(lambda: client.hget(key, "t:l"), lambda v: float(v) >= 4890)
        giving_back.cancel()
        await client.aclose()

    run(scenario)

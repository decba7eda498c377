"""The Consul adapters: routing documents from KV and endpoints from the health API.

They run against a real agent when CONSUL_HTTP_ADDR is set, otherwise against
tests/consul_double.py. Faults (unreachable agent, indexes going backwards) are made
with the double, which can produce them on demand.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import consul.aio

from llmmesh.policy.library import RuleLibrary
from llmmesh.runtime.consul import CONSUL_ERRORS, ConsulKeyWatch, ConsulPrefixWatch, connect
from llmmesh.types import PolicyAction
from services.router.consul import ConsulDiscovery
from services.router.endpoints import Endpoint
from services.router.routing import ROUTING_REJECTED, PolicyHolder, RoutingPolicy, render_policy
from services.router.tenants import Tenants, hash_key
from tests.consul_double import ConsulDouble

T = TypeVar("T")
KEY = f"llm-mesh-test/routing-{os.getpid()}"
SERVICE = f"inference-test-{os.getpid()}"


async def next_within(stream: AsyncIterator[T], seconds: float = 5.0) -> T:
    return await asyncio.wait_for(anext(stream), seconds)


async def with_consul(
    scenario: Callable[[consul.aio.Consul, ConsulDouble | None], Awaitable[None]],
    double_only: bool = False,
) -> None:
    """Runs ``scenario`` against the real agent if configured (unless it needs to inject
    faults), else against the double."""
    real = os.environ.get("CONSUL_HTTP_ADDR")
    double = None if real and not double_only else ConsulDouble()
    address = await double.start() if double else real or ""
    client = connect(address)
    try:
        await scenario(client, double)
    finally:
        await client.close()
        if double:
            await double.stop()


def rejected() -> float:
    return float(ROUTING_REJECTED.labels("consul")._value.get())


def test_a_kv_write_applies_at_once_and_an_invalid_one_is_rejected_whole() -> None:
    async def scenario(client: consul.aio.Consul, _: ConsulDouble | None) -> None:
        holder = PolicyHolder()
        await client.kv.put(KEY, render_policy(RoutingPolicy(split={"stable": 100})))
        docs = ConsulKeyWatch(client, KEY, wait="5s").watch()
        assert holder.offer(await next_within(docs), "consul")
        assert holder.current.split == {"stable": 100}

        written = time.monotonic()
        await client.kv.put(KEY, '{"split": {"stable": 90, "canary": 10}}')
        assert holder.offer(await next_within(docs), "consul")
        assert time.monotonic() - written < 1.0
        assert holder.current.split == {"stable": 90, "canary": 10}

        before = rejected()
        await client.kv.put(KEY, '{"split": {"stable": 50, "canary": -5}, "colors": {}}')
        assert not holder.offer(await next_within(docs), "consul")
        assert rejected() == before + 1
        assert holder.current.split == {"stable": 90, "canary": 10}
        await docs.aclose()

    asyncio.run(with_consul(scenario))


def test_the_watch_follows_an_index_that_goes_backwards() -> None:
    async def scenario(client: consul.aio.Consul, double: ConsulDouble | None) -> None:
        assert double is not None
        await client.kv.put(KEY, "split: {stable: 1}")
        docs = ConsulKeyWatch(client, KEY, wait="5s").watch()
        assert await next_within(docs) == b"split: {stable: 1}"
        for n in range(2, 5):  # the index climbs well above what the restore resets it to
            await client.kv.put(KEY, f"split: {{stable: {n}}}")
            assert await next_within(docs) == f"split: {{stable: {n}}}".encode()
        await double.restore_snapshot()
        await next_within(docs)  # the full re-read after the reset
        await client.kv.put(KEY, "split: {canary: 1}")
        assert await next_within(docs) == b"split: {canary: 1}"
        # Blocking queries never ran with an index below 1 after the first read.
        assert not any("index=0" in r for r in double.requests)
        await docs.aclose()

    asyncio.run(with_consul(scenario, double_only=True))


def test_an_unreachable_agent_keeps_the_last_value_and_recovers() -> None:
    async def scenario(client: consul.aio.Consul, double: ConsulDouble | None) -> None:
        assert double is not None
        port = int(client.http.base_uri.rsplit(":", 1)[1])
        await client.kv.put(KEY, "split: {stable: 1}")
        docs = ConsulKeyWatch(client, KEY, wait="1s").watch()
        assert await next_within(docs) == b"split: {stable: 1}"
        waiting = asyncio.ensure_future(anext(docs))
        errors = CONSUL_ERRORS.labels(f"kv/{KEY}")._value.get()
        await double.stop()  # the agent goes away mid-query, then comes back
        while CONSUL_ERRORS.labels(f"kv/{KEY}")._value.get() < errors + 2:
            await asyncio.wait({waiting}, timeout=0.05)  # polls a condition
        assert not waiting.done()  # failed queries yield nothing: the last value stays
        await double.start(port)
        await client.kv.put(KEY, "split: {canary: 1}")
        assert await asyncio.wait_for(waiting, 15) == b"split: {canary: 1}"
        await docs.aclose()

    asyncio.run(with_consul(scenario, double_only=True))


def test_discovery_lists_passing_instances_with_their_metadata() -> None:
    async def scenario(client: consul.aio.Consul, _: ConsulDouble | None) -> None:
        def register(sid: str, port: int, meta: dict[str, str]) -> Awaitable[bool]:
            return client.agent.service.register(  # type: ignore[no-any-return]
                SERVICE, service_id=sid, address="127.0.0.1", port=port, meta=meta
            )

        meta = {"version": "stable", "region": "eu", "model": "llm", "device": "gpu-0"}
        await register("a", 7001, meta)
        endpoints = ConsulDiscovery(client, SERVICE, wait="5s").watch()
        assert await next_within(endpoints) == [
            Endpoint(
                address="127.0.0.1:7001",
                version="stable",
                region="eu",
                models=("llm",),
                device="gpu-0",
            )
        ]
        await register("b", 7002, {"version": "canary"})
        listed = await next_within(endpoints)
        assert all(e.triton_metrics_url == "" for e in listed)  # inference services
        assert sorted((e.address, e.version, e.region) for e in listed) == [
            ("127.0.0.1:7001", "stable", "eu"),
            ("127.0.0.1:7002", "canary", "dc1"),  # no region: the datacenter
        ]
        await client.agent.service.deregister("a")
        assert [e.address for e in await next_within(endpoints)] == ["127.0.0.1:7002"]
        metrics = "http://127.0.0.1:8002/metrics"
        await register("t", 8001, {"triton_metrics_url": metrics})
        listed = await next_within(endpoints)
        assert [e.triton_metrics_url for e in listed if e.address.endswith(":8001")] == [metrics]
        await client.agent.service.deregister("b")
        await endpoints.aclose()

    asyncio.run(with_consul(scenario))


def test_tenants_follow_their_kv_key() -> None:
    async def scenario(client: consul.aio.Consul, _: ConsulDouble | None) -> None:
        key = f"{KEY}-tenants"
        tenants = Tenants(enabled=True)
        doc = {"tenants": [{"id": "a", "api_key_hashes": [hash_key("key-a")]}]}
        await client.kv.put(key, json.dumps(doc))
        values = ConsulKeyWatch(client, key, wait="5s").watch()
        assert tenants.offer(await next_within(values), "consul")
        assert tenants.authenticate("Bearer key-a") == "a"
        await client.kv.put(key, "tenants: [{id: b, tier: gold}]")  # invalid: refused
        assert not tenants.offer(await next_within(values), "consul")
        assert tenants.authenticate("Bearer key-a") == "a"
        await values.aclose()

    asyncio.run(with_consul(scenario))


def test_policy_rule_sets_follow_a_kv_prefix() -> None:
    prefix = f"llm-mesh-test/policy-{os.getpid()}/"
    rules = "version: {v}\nrules: [{{id: deny-x, action: deny, keywords: [{word}]}}]\n"

    async def scenario(client: consul.aio.Consul, _: ConsulDouble | None) -> None:
        library = RuleLibrary()
        await client.kv.put(prefix + "default", rules.format(v="d1", word="apples"))
        await client.kv.put(prefix + "acme", "version: a1\nextends: default\nrules: []\n")
        sets = ConsulPrefixWatch(client, prefix, wait="5s").watch()
        assert library.offer(await next_within(sets), "consul")
        assert library.versions() == {"acme": "a1+d1", "default": "d1"}
        assert library.get("acme").check_input("apples").action is PolicyAction.DENY

        await client.kv.put(prefix + "acme", "version: a2\nextends: nowhere\nrules: []\n")
        assert not library.offer(await next_within(sets), "consul")
        assert library.versions()["acme"] == "a1+d1"

        await client.kv.put(prefix + "default", rules.format(v="d2", word="pears"))
        await client.kv.put(prefix + "acme", "version: a3\nextends: default\nrules: []\n")
        while library.versions()["acme"] != "a3+d2":
            library.offer(await next_within(sets), "consul")
        assert library.get("acme").check_input("pears").action is PolicyAction.DENY
        await sets.aclose()
        await client.kv.delete(prefix, recurse=True)

    asyncio.run(with_consul(scenario))

"""The routing document, its file source, the endpoints file and the circuit breaker."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from pydantic import ValidationError

from llmmesh.runtime.watch import watch_file
from services.router.breaker import BreakerState, CircuitBreaker
from services.router.config import RouterConfig
from services.router.endpoints import DnsDiscovery, Endpoint, FileDiscovery
from services.router.routing import (
    ROUTING_REJECTED,
    InvalidDocument,
    PolicyHolder,
    RoutingPolicy,
    parse_policy,
    render_policy,
)


def test_a_document_round_trips_and_defaults_fill_the_rest() -> None:
    policy = parse_policy("split: {stable: 95, canary: 5}\ncolors: {blue: canary}\n")
    assert policy.split == {"stable": 95, "canary": 5} and policy.colors == {"blue": "canary"}
    assert policy.algorithm == "llm_aware" and policy.weights.waiting == 4.0
    assert parse_policy(render_policy(policy)) == policy
    assert parse_policy("") == RoutingPolicy()


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("split: [1, 2]", "split"),
        ("split: {stable: -1}", "split"),
        ("split: {stable: 0}", "at least one weight"),
        ("algorithm: fastest", "algorithm"),
        ("weights: {waiting: -2}", "weights.waiting"),
        ("colours: {blue: canary}", "colours"),  # typos are errors, not silently ignored
        ("colors: {blue: ''}", "colors"),
        ("[not, a, mapping]", "mapping"),
        ("split: {stable: 1", "YAML"),
    ],
)
def test_invalid_documents_are_rejected_with_the_reason(text: str, reason: str) -> None:
    with pytest.raises(InvalidDocument, match=reason):
        parse_policy(text)


def test_the_holder_keeps_the_last_good_document() -> None:
    holder = PolicyHolder()
    assert holder.offer("split: {stable: 90, canary: 10}", "file")
    before = ROUTING_REJECTED.labels("file")._value.get()
    assert not holder.offer("split: {stable: 90, canary: -10}", "file")
    assert holder.current.split == {"stable": 90, "canary": 10}
    assert ROUTING_REJECTED.labels("file")._value.get() == before + 1


def test_file_watch_sees_every_change_including_replacement_by_rename(tmp_path: Path) -> None:
    async def scenario() -> None:
        path = tmp_path / "routing.yaml"
        texts = watch_file(path, 0.01)
        pending = asyncio.ensure_future(anext(texts))
        path.write_text("a")  # the file appears after the watch began
        assert await asyncio.wait_for(pending, 5) == "a"
        path.write_text("b")  # same size, same coarse mtime: still seen
        assert await asyncio.wait_for(anext(texts), 5) == "b"
        (tmp_path / "new").write_text("c")
        (tmp_path / "new").replace(path)
        assert await asyncio.wait_for(anext(texts), 5) == "c"
        await texts.aclose()

    asyncio.run(scenario())


def test_endpoints_file_lists_metadata_and_a_bad_edit_is_skipped(tmp_path: Path) -> None:
    async def scenario() -> None:
        path = tmp_path / "endpoints.yaml"
        path.write_text(
            "endpoints:\n"
            "  - {address: 'h:1', version: canary, region: us, models: [llm]}\n"
            "  - {address: 'h:2'}\n"
        )
        lists = FileDiscovery(path, 0.01).watch()
        assert await asyncio.wait_for(anext(lists), 5) == [
            Endpoint(address="h:1", version="canary", region="us", models=("llm",)),
            Endpoint(address="h:2", version="stable", region="", models=()),
        ]
        path.write_text("endpoints:\n  - {address: 'no port'}\n")  # rejected, logged
        path.write_text("endpoints:\n  - {address: 'h:3'}\n")
        assert await asyncio.wait_for(anext(lists), 5) == [Endpoint(address="h:3")]
        await lists.aclose()

    asyncio.run(scenario())


def test_an_endpoint_may_be_a_triton_server_named_by_its_metrics_url() -> None:
    triton = Endpoint(address="h:8001", triton_metrics_url="http://h:8002/metrics")
    assert triton.triton_metrics_url == "http://h:8002/metrics"
    assert Endpoint(address="h:1").triton_metrics_url == ""  # an inference service
    with pytest.raises(ValidationError, match="triton_metrics_url"):
        Endpoint(address="h:8001", triton_metrics_url="h:8002/metrics")  # not a URL


def test_breaker_opens_after_consecutive_failures_and_probes_once() -> None:
    breaker = CircuitBreaker(failure_threshold=3, open_s=2.0)
    breaker.on_failure(0.0)
    breaker.on_success()  # failures must be consecutive
    for t in (1.0, 1.1):
        breaker.on_failure(t)
    assert breaker.available(1.2)
    breaker.on_failure(1.2)
    assert breaker.state(1.3) is BreakerState.OPEN and not breaker.available(3.1)
    # After the cool-down one probe goes through, and only one.
    assert breaker.state(3.3) is BreakerState.HALF_OPEN and breaker.available(3.3)
    breaker.on_pick(3.3)
    assert not breaker.available(3.4)
    breaker.on_failure(3.5)  # the probe failed: open again, a full cool-down
    assert not breaker.available(5.0) and breaker.available(5.6)
    breaker.on_pick(5.6)
    breaker.on_success()
    assert breaker.state(5.7) is BreakerState.CLOSED


def test_an_abandoned_probe_frees_the_probe_slot() -> None:
    breaker = CircuitBreaker(failure_threshold=1, open_s=1.0)
    breaker.on_failure(0.0)
    breaker.on_pick(1.5)
    breaker.on_abandon()
    assert breaker.available(1.6)


def test_a_probe_that_never_reports_back_lets_another_probe_after_a_cool_down() -> None:
    breaker = CircuitBreaker(failure_threshold=1, open_s=1.0)
    breaker.on_failure(0.0)
    breaker.on_pick(1.5)  # its request never says how it went
    assert not breaker.available(2.4)
    assert breaker.available(2.5)
    breaker.on_pick(2.5)
    breaker.on_success()
    assert breaker.state(2.6) is BreakerState.CLOSED


def test_dns_discovery_lists_every_address_of_each_subsets_name() -> None:
    async def scenario() -> list[Endpoint]:
        discovery = DnsDiscovery(
            {"stable": "localhost:50061", "canary": "127.0.0.1:50062"}, "eu", 0.01
        )
        updates = discovery.watch()
        first = await asyncio.wait_for(anext(updates), 5)
        await updates.aclose()
        return first

    endpoints = asyncio.run(scenario())
    assert [(e.address, e.version, e.region) for e in endpoints] == [
        ("127.0.0.1:50061", "stable", "eu"),
        ("127.0.0.1:50062", "canary", "eu"),
    ]


def test_dns_discovery_needs_names() -> None:
    with pytest.raises(ValueError, match="dns_endpoints"):
        RouterConfig(discovery="dns")
    with pytest.raises(ValueError, match="host:port"):
        RouterConfig(discovery="dns", dns_endpoints={"stable": "inference-stable"})

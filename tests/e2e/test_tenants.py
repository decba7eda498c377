"""Tenants through the real stack: API keys, allowed models, budgets, concurrency,
session isolation."""

from __future__ import annotations

import contextlib
import json
import math
import secrets
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from llmmesh.client import authorized_channel, build_request
from llmmesh.launcher import Stack, StackPorts
from llmmesh.v1 import common_pb2, generation_pb2_grpc
from services.router.tenants import hash_key
from tests.conftest import (
    bad_request_fields,
    collect,
    metric_value,
    start_service,
    wait_for,
)

TENANTS: dict[str, dict[str, object]] = {
    "alice": {"models": ["llm"]},
    "bob": {},
    "hasty": {"requests_per_minute": 3},
    "thrifty": {"tokens_per_minute": 240, "on_budget_exhausted": "finish"},
    "solo": {"max_concurrent_streams": 1},
}


@pytest.fixture(scope="module")
def tenant_router(
    stack: Stack, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, dict[str, str]]]:
    """A router with the tenants above; yields its address and each tenant's key."""
    tmp = tmp_path_factory.mktemp("tenants")
    tenants_file = tmp / "tenants.json"
    keys = write_tenants(
        tenants_file, {name: {"id": name, **spec} for name, spec in TENANTS.items()}
    )
    port = StackPorts.free().router
    router = start_service(stack, "router", port, tmp, tenants_file=str(tenants_file))
    try:
        yield f"127.0.0.1:{port}", keys
    finally:
        router.terminate(5)


def write_tenants(path: Path, specs: dict[str, dict[str, object]]) -> dict[str, str]:
    """A tenants file with a fresh API key per spec (name -> tenant fields); the keys."""
    keys = {name: secrets.token_urlsafe(16) for name in specs}
    tenants = [{**spec, "api_key_hashes": [hash_key(keys[name])]} for name, spec in specs.items()]
    path.write_text(json.dumps({"tenants": tenants}))
    return keys


@contextlib.contextmanager
def http_tenant_router(
    stack: Stack, workdir: Path, tenants: dict[str, dict[str, object]], **settings: str
) -> Iterator[tuple[str, dict[str, str]]]:
    """A router over the stack with these tenants (name -> fields) and its own HTTP
    port: its OpenAI base URL and each tenant's API key."""
    keys = write_tenants(workdir / "tenants.json", tenants)
    ports = StackPorts.free()
    router = start_service(
        stack,
        "router",
        ports.router,
        workdir,
        tenants_file=str(workdir / "tenants.json"),
        http_port=str(ports.router_http),
        **settings,
    )
    try:
        yield f"http://127.0.0.1:{ports.router_http}/v1", keys
    finally:
        router.terminate(5)


def refusal(address: str, key: str, prompt: str = "hi", **kwargs: object) -> grpc.RpcError:
    with authorized_channel(address, key) as channel, pytest.raises(grpc.RpcError) as info:
        collect(channel, prompt, **kwargs)  # type: ignore[arg-type]
    return info.value


def retry_delay_s(err: grpc.RpcError) -> float:
    status = rpc_status.from_call(err)  # type: ignore[arg-type]
    for detail in status.details if status else ():
        if detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            info = error_details_pb2.RetryInfo()
            detail.Unpack(info)
            return float(info.retry_delay.ToMilliseconds()) / 1000
    raise AssertionError("no RetryInfo in the status")


def test_missing_or_unknown_keys_are_unauthenticated(
    tenant_router: tuple[str, dict[str, str]],
) -> None:
    address, _ = tenant_router
    for key in ("", "not-a-key"):
        err = refusal(address, key)
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "key" in (err.details() or "").lower()


def test_a_model_the_tenant_may_not_use_is_permission_denied(
    tenant_router: tuple[str, dict[str, str]],
) -> None:
    address, keys = tenant_router
    err = refusal(address, keys["alice"], model="llm_canary", max_tokens=2)
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "llm_canary" in (err.details() or "")
    unknown = refusal(address, keys["alice"], model="gpt-17", max_tokens=2)
    assert unknown.code() == grpc.StatusCode.NOT_FOUND
    assert (unknown.details() or "").endswith("served: ['llm']"), "only the tenant's models"
    with authorized_channel(address, keys["alice"]) as channel:
        assert (
            collect(channel, "hi", model="llm", max_tokens=2, ignore_eos=True)[
                -1
            ].usage.completion_tokens
            == 2
        )


def test_over_requests_per_minute_is_refused_with_a_retry_delay(
    tenant_router: tuple[str, dict[str, str]],
) -> None:
    address, keys = tenant_router
    left = []
    with authorized_channel(address, keys["hasty"]) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        for _ in range(3):
            call = stub.Generate(build_request("hi", max_tokens=1), timeout=60)
            list(call)
            trailers = dict(call.trailing_metadata() or ())
            left.append(trailers["x-ratelimit-remaining-requests"])
    assert left == ["2", "1", "0"]  # also in the trailers, as OpenAI's headers
    err = refusal(address, keys["hasty"], max_tokens=1)
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert 0 < retry_delay_s(err) <= 20  # one request refills in 60 s / 3


def test_a_long_stream_stops_at_the_token_budget(
    tenant_router: tuple[str, dict[str, str]],
) -> None:
    address, keys = tenant_router
    started = time.monotonic()
    with authorized_channel(address, keys["thrifty"]) as channel:
        responses = collect(channel, "spend", max_tokens=1000, ignore_eos=True)
    refilled = math.ceil(240 / 60 * (time.monotonic() - started))  # the bucket refills
    final = responses[-1]
    assert final.finish_reason == common_pb2.FINISH_REASON_BUDGET
    spent = final.usage.prompt_tokens + final.usage.completion_tokens
    # Charged as relayed: at most the last chunk past the budget and what refilled while
    # streaming (the byte-level model's text is one token a character).
    assert 240 <= spent <= 240 + refilled + len(final.text)
    err = refusal(address, keys["thrifty"], max_tokens=1)
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert retry_delay_s(err) > 0


def test_a_tenant_cannot_exceed_its_concurrent_streams(
    tenant_router: tuple[str, dict[str, str]],
) -> None:
    address, keys = tenant_router
    with authorized_channel(address, keys["solo"]) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        first = stub.Generate(build_request("hold", max_tokens=500, ignore_eos=True))
        next(first)  # streaming now
        err = refusal(address, keys["solo"], max_tokens=1)
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "streams" in (err.details() or "")
        first.cancel()

        def admitted() -> bool:
            try:
                collect(channel, "again", max_tokens=1)
            except grpc.RpcError as again:
                assert again.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                return False
            return True

        # The cancelled stream's slot is freed once the router sees the cancellation.
        wait_for(admitted, 10, "the cancelled stream's slot")


def test_a_session_id_never_reaches_another_tenants_conversation(
    tenant_router: tuple[str, dict[str, str]], tmp_path: Path
) -> None:
    address, keys = tenant_router
    session = f"shared-{secrets.token_hex(4)}"
    with authorized_channel(address, keys["alice"]) as alice:
        collect(alice, "My name is Ada.", max_tokens=8, session_id=session)
    with authorized_channel(address, keys["bob"]) as bob:
        same_id = collect(bob, "What is my name?", max_tokens=8, session_id=session)
        fresh = collect(bob, "What is my name?", max_tokens=8, session_id=session + "-b")
    # Bob's prompt under Alice's session id carries no history: exactly a fresh session's.
    assert same_id[-1].usage.prompt_tokens == fresh[-1].usage.prompt_tokens


def test_a_clients_cache_salt_partitions_only_its_own_tenants_cache(
    tenant_router: tuple[str, dict[str, str]],
) -> None:
    """Over gRPC (GenerateRequest.cache_salt), through Triton's engine: the same salt from
    another tenant reaches nothing of this tenant's, no salt is another partition, and an
    overlong salt is refused naming the field."""
    address, keys = tenant_router
    prompt = f"A long shared preamble {secrets.token_hex(8)}. " * 4

    def cached(tenant: str, salt: str) -> int:
        request = build_request(prompt, max_tokens=1)
        request.cache_salt = salt
        with authorized_channel(address, keys[tenant]) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            return list(stub.Generate(request, timeout=60))[-1].usage.cached_tokens

    assert cached("alice", "user-1") == 0
    assert cached("bob", "user-1") == 0 and cached("alice", "") == 0
    assert cached("alice", "user-1") > 0
    with pytest.raises(grpc.RpcError) as refused:
        cached("alice", "s" * 257)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert bad_request_fields(refused.value) == ["cache_salt"]


@dataclass(frozen=True)
class OneSlotRouter:
    address: str
    metrics: str
    keys: dict[str, str]  # tier -> key of that tier's tenant

    def queued(self) -> float:
        return sum(
            metric_value(self.metrics, "llm_router_queued_requests", {"tier": tier})
            for tier in self.keys
        )


@pytest.fixture(scope="module")
def one_slot_router(
    stack: Stack, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[OneSlotRouter]:
    """A router whose admission window is one stream wide, with a tenant per tier; the
    queue between tiers as it runs for engines without priority (with it, a higher tier
    does not wait for a lower one's slot: tests/e2e/test_priority.py)."""
    tmp = tmp_path_factory.mktemp("queue")
    tenants_file = tmp / "tenants.json"
    tiers = ("critical", "standard", "sheddable")
    keys = write_tenants(tenants_file, {t: {"id": f"{t}-tenant", "tier": t} for t in tiers})
    ports = StackPorts.free()
    router = start_service(
        stack,
        "router",
        ports.router,
        tmp,
        tenants_file=str(tenants_file),
        metrics_port=str(ports.router_metrics),
        admission__initial_limit="1",
        admission__min_limit="1",
        admission__max_limit="1",
        admission__max_queue_wait_s='{"critical": 60, "standard": 60, "sheddable": 0.5}',
        admission__engine_priority="false",
    )
    try:
        yield OneSlotRouter(
            f"127.0.0.1:{ports.router}", f"http://127.0.0.1:{ports.router_metrics}/metrics", keys
        )
    finally:
        router.terminate(5)


class Held:
    """A long stream that occupies the only slot until ``release``."""

    def __init__(self, address: str, key: str) -> None:
        self._channel = authorized_channel(address, key)
        stub = generation_pb2_grpc.GenerationStub(self._channel)
        self._call = stub.Generate(build_request("hold", max_tokens=1000, ignore_eos=True))
        next(self._call)  # admitted and streaming

    def release(self) -> None:
        self._call.cancel()
        self._channel.close()


def test_queued_requests_are_served_in_priority_order(one_slot_router: OneSlotRouter) -> None:
    router = one_slot_router
    held = Held(router.address, router.keys["standard"])
    finished: list[str] = []

    def run(tier: str) -> None:
        with authorized_channel(router.address, router.keys[tier]) as channel:
            collect(channel, f"{tier} request", max_tokens=2)
        finished.append(tier)

    threads = [threading.Thread(target=run, args=(tier,)) for tier in ("standard", "critical")]
    threads[0].start()
    wait_for(lambda: router.queued() == 1, 10, "the standard request to queue")
    threads[1].start()  # the critical one arrives last
    wait_for(lambda: router.queued() == 2, 10, "the critical request to queue")
    held.release()
    for thread in threads:
        thread.join(60)
    assert finished == ["critical", "standard"]


def test_a_cancelled_queued_request_frees_its_place(one_slot_router: OneSlotRouter) -> None:
    router = one_slot_router
    held = Held(router.address, router.keys["standard"])
    with authorized_channel(router.address, router.keys["critical"]) as channel:
        call = generation_pb2_grpc.GenerationStub(channel).Generate(
            build_request("never mind", max_tokens=2)
        )
        threading.Thread(target=_drain, args=(call,), daemon=True).start()
        wait_for(lambda: router.queued() == 1, 10, "the critical request to queue")
        call.cancel()
        wait_for(lambda: router.queued() == 0, 10, "the cancelled request to leave the queue")
    held.release()
    # The slot goes to the next request, not to the one that left.
    with authorized_channel(router.address, router.keys["standard"]) as channel:
        assert (
            collect(channel, "next", max_tokens=2, ignore_eos=True)[-1].usage.completion_tokens == 2
        )


def test_a_request_that_cannot_get_a_slot_in_time_is_answered_by_its_deadline(
    one_slot_router: OneSlotRouter,
) -> None:
    router = one_slot_router
    held = Held(router.address, router.keys["standard"])
    try:
        sent = time.monotonic()
        err = refusal(router.address, router.keys["sheddable"], max_tokens=2)
        # Its tier waits 0.5 s at most: refused at once when the queue's pace says it
        # cannot make it (with a retry delay), or told at the deadline.
        assert time.monotonic() - sent < 0.5 + 1.0
        if err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
            assert retry_delay_s(err) > 0
        else:
            assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert "slot" in (err.details() or "")
    finally:
        held.release()


def _drain(call: Any) -> None:
    with contextlib.suppress(grpc.RpcError):
        for _ in call:
            pass


def test_policy_down_refuses_fail_closed_tenants_and_admits_fail_open_ones(
    stack: Stack, tmp_path: Path
) -> None:
    tenants_file = tmp_path / "tenants.json"
    modes = ("open", "closed")
    keys = write_tenants(
        tenants_file, {m: {"id": f"fail-{m}", "policy_fail_mode": m} for m in modes}
    )
    ports = StackPorts.free()
    router = start_service(
        stack,
        "router",
        ports.router,
        tmp_path,
        tenants_file=str(tenants_file),
        policy_address=f"127.0.0.1:{ports.policy}",  # nothing listens there
        upstream_timeout_s="0.5",
    )
    address = f"127.0.0.1:{ports.router}"
    try:
        err = refusal(address, keys["closed"], max_tokens=2)
        assert err.code() == grpc.StatusCode.UNAVAILABLE
        assert "policy" in (err.details() or "")
        with authorized_channel(address, keys["open"]) as channel:
            responses = collect(channel, "hello", max_tokens=2, ignore_eos=True)
        assert responses[-1].usage.completion_tokens == 2
    finally:
        router.terminate(5)

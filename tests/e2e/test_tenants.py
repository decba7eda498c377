"""Tenants through the real stack: API keys, allowed models, budgets, concurrency,
session isolation."""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from llmmesh.client import authorized_channel, build_request
from llmmesh.launcher import Stack, StackPorts
from llmmesh.v1 import common_pb2, generation_pb2_grpc
from services.router.tenants import hash_key
from tests.conftest import collect, start_service, wait_for

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
    keys = {name: secrets.token_urlsafe(16) for name in TENANTS}
    doc = {
        "tenants": [
            {"id": name, "api_key_hashes": [hash_key(keys[name])], **spec}
            for name, spec in TENANTS.items()
        ]
    }
    tenants_file = tmp / "tenants.json"
    tenants_file.write_text(json.dumps(doc))
    port = StackPorts.free().router
    router = start_service(stack, "router", port, tmp, tenants_file=str(tenants_file))
    try:
        yield f"127.0.0.1:{port}", keys
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
    with authorized_channel(address, keys["alice"]) as channel:
        assert collect(channel, "hi", model="llm", max_tokens=2)[-1].usage.completion_tokens == 2


def test_over_requests_per_minute_is_refused_with_a_retry_delay(
    tenant_router: tuple[str, dict[str, str]],
) -> None:
    address, keys = tenant_router
    with authorized_channel(address, keys["hasty"]) as channel:
        for _ in range(3):
            collect(channel, "hi", max_tokens=1)
    err = refusal(address, keys["hasty"], max_tokens=1)
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert 0 < retry_delay_s(err) <= 20  # one request refills in 60 s / 3


def test_a_long_stream_stops_at_the_token_budget(
    tenant_router: tuple[str, dict[str, str]],
) -> None:
    address, keys = tenant_router
    with authorized_channel(address, keys["thrifty"]) as channel:
        responses = collect(channel, "spend", max_tokens=1000, ignore_eos=True)
    final = responses[-1]
    assert final.finish_reason == common_pb2.FINISH_REASON_BUDGET
    spent = final.usage.prompt_tokens + final.usage.completion_tokens
    # Charged as relayed: at most one chunk past the budget (chunks hold a few tokens).
    assert 240 <= spent <= 240 + 8
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

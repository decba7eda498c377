"""The context service for real: durability across kill -9 (SQLite, and Redis with its
append-only file), the session API, and sessions through the router."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from llmmesh.client import authorized_channel, internal_channel
from llmmesh.launcher import Stack, StackPorts
from llmmesh.launcher.process import Child
from llmmesh.launcher.redis import start_redis
from llmmesh.runtime.internal_auth import token_metadata
from llmmesh.v1 import context_pb2, context_pb2_grpc
from tests.conftest import bad_request_fields, collect, start_service
from tests.e2e.test_tenants import write_tenants

WORKERS = 16
ACKS_BEFORE_KILL = 300


def kill_hard(child: Child) -> None:
    os.killpg(child.process.pid, signal.SIGKILL)
    child.process.wait()


async def append_until_killed(
    address: str, token: str, kill: Callable[[], None]
) -> dict[str, list[str]]:
    """Appends from WORKERS concurrent clients, each to its own session, and kills the
    service once ACKS_BEFORE_KILL appends were acknowledged; returns the acknowledged
    request ids per session."""
    acked: dict[str, list[str]] = {f"burst-{w}": [] for w in range(WORKERS)}
    killed = asyncio.Event()

    async def worker(session_id: str) -> None:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = context_pb2_grpc.ContextStub(channel)
            for n in range(10_000):
                request = context_pb2.AppendTurnsRequest(
                    tenant="durable",
                    session_id=session_id,
                    request_id=f"{session_id}-{n}",
                    turns=[context_pb2.Turn(role=context_pb2.ROLE_USER, text=f"turn {n}")],
                )
                try:
                    await stub.AppendTurns(request, timeout=5, metadata=token_metadata(token))
                except grpc.aio.AioRpcError:
                    return  # the service is gone: this append was not acknowledged
                acked[session_id].append(request.request_id)
                if sum(map(len, acked.values())) >= ACKS_BEFORE_KILL and not killed.is_set():
                    killed.set()
                    kill()

    await asyncio.gather(*(worker(s) for s in acked))
    assert killed.is_set()
    return acked


def assert_all_acknowledged_turns_survived(
    address: str, token: str, acked: dict[str, list[str]]
) -> None:
    with internal_channel(address, token) as channel:
        stub = context_pb2_grpc.ContextStub(channel)
        for session_id, request_ids in acked.items():
            session = stub.LoadSession(
                context_pb2.LoadSessionRequest(tenant="durable", session_id=session_id),
                timeout=10,
            )
            stored = [t.request_id for t in session.turns]
            # Everything acknowledged is there, in order; at most the appends in flight
            # at the kill may have landed unacknowledged after them.
            assert stored[: len(request_ids)] == request_ids, session_id
            assert len(stored) <= len(request_ids) + 1


def test_kill_9_loses_no_acknowledged_turn_with_sqlite(stack: Stack, tmp_path: Path) -> None:
    port = StackPorts.free().context
    settings = {"store": json.dumps({"kind": "sqlite", "path": str(tmp_path / "durable.sqlite3")})}
    context = start_service(stack, "context", port, tmp_path, **settings)
    acked = asyncio.run(
        append_until_killed(f"127.0.0.1:{port}", stack.internal_token, lambda: kill_hard(context))
    )
    restarted = start_service(stack, "context", port, tmp_path, **settings)
    try:
        assert_all_acknowledged_turns_survived(f"127.0.0.1:{port}", stack.internal_token, acked)
    finally:
        restarted.terminate(5)


def test_kill_9_of_service_and_redis_loses_no_acknowledged_turn(
    stack: Stack, tmp_path: Path
) -> None:
    ports = StackPorts.free()
    redis = start_redis(tmp_path / "redis", ports.triton_http)
    redis_store = {"kind": "redis", "url": f"redis://127.0.0.1:{ports.triton_http}/0"}
    settings = {"store": json.dumps(redis_store)}
    context = start_service(stack, "context", ports.context, tmp_path, **settings)

    def kill_both() -> None:
        kill_hard(context)
        kill_hard(redis)

    acked = asyncio.run(
        append_until_killed(f"127.0.0.1:{ports.context}", stack.internal_token, kill_both)
    )
    redis = start_redis(tmp_path / "redis", ports.triton_http)  # recovers from its AOF
    restarted = start_service(stack, "context", ports.context, tmp_path, **settings)
    try:
        assert_all_acknowledged_turns_survived(
            f"127.0.0.1:{ports.context}", stack.internal_token, acked
        )
    finally:
        restarted.terminate(5)
        redis.terminate(5)


@pytest.fixture
def context_stub(stack: Stack) -> Iterator[context_pb2_grpc.ContextStub]:
    with internal_channel(stack.address("context"), stack.internal_token) as channel:
        yield context_pb2_grpc.ContextStub(channel)


def test_put_list_delete_and_tenant_isolation(context_stub: context_pb2_grpc.ContextStub) -> None:
    stub = context_stub
    stub.PutSession(
        context_pb2.PutSessionRequest(
            tenant="iso-a", session_id="chat-1", system_prompt="Be brief.", metadata={"k": "v"}
        )
    )
    session = stub.LoadSession(context_pb2.LoadSessionRequest(tenant="iso-a", session_id="chat-1"))
    assert (session.system_prompt, dict(session.metadata)) == ("Be brief.", {"k": "v"})
    listed = stub.ListSessions(context_pb2.ListSessionsRequest(tenant="iso-a"))
    assert list(listed.session_ids) == ["chat-1"] and not listed.next_page_token

    errors = []
    for tenant, session_id in (("iso-b", "chat-1"), ("iso-a", "chat-2")):
        with pytest.raises(grpc.RpcError) as info:
            stub.LoadSession(context_pb2.LoadSessionRequest(tenant=tenant, session_id=session_id))
        errors.append((info.value.code(), (info.value.details() or "").replace(session_id, "?")))
    # Another tenant's session and a missing one cannot be told apart.
    assert errors[0] == errors[1] == (grpc.StatusCode.NOT_FOUND, "no session '?'")
    assert not stub.DeleteSession(
        context_pb2.DeleteSessionRequest(tenant="iso-b", session_id="chat-1")
    ).deleted
    assert stub.DeleteSession(
        context_pb2.DeleteSessionRequest(tenant="iso-a", session_id="chat-1")
    ).deleted
    with pytest.raises(grpc.RpcError) as gone:
        stub.LoadSession(context_pb2.LoadSessionRequest(tenant="iso-a", session_id="chat-1"))
    assert gone.value.code() == grpc.StatusCode.NOT_FOUND


def test_a_model_summary_is_stored_only_over_the_one_it_replaces(
    context_stub: context_pb2_grpc.ContextStub,
) -> None:
    """SaveSummary (model_summary's folds): a summary written over the stored one lands,
    one written over a summary since replaced does not, and a session's loads then stand
    the summary for the turns it covers."""
    stub = context_stub
    turns = [
        context_pb2.Turn(role=role, text=f"turn {i}", token_count=2)
        for i, role in enumerate([context_pb2.ROLE_USER, context_pb2.ROLE_ASSISTANT] * 2)
    ]
    stub.AppendTurns(
        context_pb2.AppendTurnsRequest(tenant="sum", session_id="s", request_id="r", turns=turns)
    )

    def save(summary: str, covered: int, replaces: int) -> bool:
        request = context_pb2.SaveSummaryRequest(
            tenant="sum", session_id="s", summary=summary, covered_turns=covered,
            replaces_covered_turns=replaces,
        )  # fmt: skip
        return bool(stub.SaveSummary(request).saved)

    assert save("The user said turns 0 and 1.", 2, 0)
    assert not save("A fold that raced the first.", 2, 0)
    load = context_pb2.LoadSessionRequest(
        tenant="sum", session_id="s", budget_tokens=1000, truncation="model_summary"
    )
    session = stub.LoadSession(load)
    assert session.summary == "The user said turns 0 and 1."
    assert [t.text for t in session.turns] == ["turn 2", "turn 3"]
    assert session.truncation.summarized_turns == 2
    for covered, replaces, code in (
        (5, 2, grpc.StatusCode.INVALID_ARGUMENT),  # more turns than the session holds
        (2, 2, grpc.StatusCode.INVALID_ARGUMENT),  # covers no more than it replaces
    ):
        with pytest.raises(grpc.RpcError) as info:
            save("x", covered, replaces)
        assert info.value.code() == code
        assert bad_request_fields(info.value) == ["covered_turns"]
    missing = context_pb2.SaveSummaryRequest(tenant="other", session_id="s", summary="x",
                                             covered_turns=1)  # fmt: skip
    with pytest.raises(grpc.RpcError) as gone:
        stub.SaveSummary(missing)
    assert gone.value.code() == grpc.StatusCode.NOT_FOUND


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        (
            context_pb2.LoadSessionRequest(tenant="t", session_id="s", truncation="newest"),
            "truncation",
        ),
        (
            context_pb2.LoadSessionRequest(tenant="t", session_id="s", budget_tokens=-5),
            "budget_tokens",
        ),
        (context_pb2.LoadSessionRequest(tenant="t", session_id="s", ttl_seconds=-1), "ttl_seconds"),
        (context_pb2.ListSessionsRequest(tenant="t", page_size=5000), "page_size"),
    ],
)
def test_bad_session_requests_name_the_field(
    context_stub: context_pb2_grpc.ContextStub,
    request_: context_pb2.LoadSessionRequest | context_pb2.ListSessionsRequest,
    field: str,
) -> None:
    with pytest.raises(grpc.RpcError) as info:
        if isinstance(request_, context_pb2.ListSessionsRequest):
            context_stub.ListSessions(request_, timeout=10)
        else:
            context_stub.LoadSession(request_, timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert bad_request_fields(info.value) == [field]


def test_the_router_reports_how_it_cut_a_long_history(
    stack: Stack, context_stub: context_pb2_grpc.ContextStub
) -> None:
    tenant = "demo"  # the local stack's tenant, whose key the stack holds
    long_text = "The Falcon project ships in May. " * 40  # about 1300 tokens
    for n in range(3):
        context_stub.AppendTurns(
            context_pb2.AppendTurnsRequest(
                tenant=tenant,
                session_id="long-history",
                request_id=f"seed-{n}",
                turns=[
                    context_pb2.Turn(role=context_pb2.ROLE_USER, text=f"{n}: {long_text}"),
                    context_pb2.Turn(role=context_pb2.ROLE_ASSISTANT, text="Noted."),
                ],
            )
        )
    with authorized_channel(stack.address("router"), stack.api_key) as channel:
        plain = collect(channel, "When does Falcon ship?", session_id="long-history", max_tokens=8)
        summary = collect(
            channel,
            "And when again?",
            session_id="long-history",
            max_tokens=8,
            truncation="sliding_summary",
        )
    cut = plain[0].context
    assert cut.history_turns == 6 and cut.dropped_turns >= 2
    assert cut.truncation == "key_sentences"  # the tenants' default
    folded = summary[0].context
    assert folded.truncation == "sliding_summary" and folded.summarized_turns >= 2


def test_a_tenant_answered_without_history_when_the_store_is_down(
    stack: Stack, tmp_path: Path
) -> None:
    keys = write_tenants(
        tmp_path / "tenants.json",
        {m: {"id": f"ctx-{m}", "context_fail_mode": m} for m in ("open", "closed")},
    )
    ports = StackPorts.free()
    router = start_service(
        stack,
        "router",
        ports.router,
        tmp_path,
        tenants_file=str(tmp_path / "tenants.json"),
        context_address=f"127.0.0.1:{ports.context}",  # nothing listens there
        upstream_timeout_s="0.5",
    )
    address = f"127.0.0.1:{ports.router}"
    try:
        with (
            authorized_channel(address, keys["closed"]) as channel,
            pytest.raises(grpc.RpcError) as info,
        ):
            collect(channel, "hi", session_id="s", max_tokens=2)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        with authorized_channel(address, keys["open"]) as channel:
            responses = collect(channel, "hi", session_id="s", max_tokens=2, ignore_eos=True)
        assert responses[-1].usage.completion_tokens == 2
    finally:
        router.terminate(5)


def test_metadata_round_trips_as_json_safe_text(
    context_stub: context_pb2_grpc.ContextStub,
) -> None:
    metadata = {"quote": 'say "hi"', "json": json.dumps({"a": [1, 2]}), "unicode": "✓"}
    context_stub.PutSession(
        context_pb2.PutSessionRequest(tenant="meta", session_id="m", metadata=metadata)
    )
    loaded = context_stub.LoadSession(context_pb2.LoadSessionRequest(tenant="meta", session_id="m"))
    assert dict(loaded.metadata) == metadata

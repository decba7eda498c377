"""Internal services answer only callers with the mesh's token: through a real grpc.aio
server built by the service shell, for every RPC shape; health stays open."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmmesh.runtime.config import ConfigError, ServiceConfig
from llmmesh.runtime.internal_auth import new_token_file, token_metadata
from llmmesh.runtime.registration import add_servicer
from llmmesh.runtime.server import GrpcService
from llmmesh.v1 import policy_pb2, policy_pb2_grpc

POLICY = policy_pb2.DESCRIPTOR.services_by_name["Policy"]


class Answering(policy_pb2_grpc.PolicyServicer):
    async def CheckInput(  # noqa: N802
        self, request: policy_pb2.CheckInputRequest, context: object
    ) -> policy_pb2.CheckInputResponse:
        return policy_pb2.CheckInputResponse(rule_set_version="v1")

    async def WatchRules(  # noqa: N802
        self, request: policy_pb2.GetRulesRequest, context: object
    ) -> AsyncIterator[policy_pb2.WatchRulesResponse]:
        yield policy_pb2.WatchRulesResponse()

    async def CheckOutput(  # noqa: N802
        self, requests: AsyncIterator[policy_pb2.CheckOutputRequest], context: object
    ) -> AsyncIterator[policy_pb2.CheckOutputResponse]:
        async for _ in requests:
            yield policy_pb2.CheckOutputResponse()


async def codes(service: GrpcService, metadata: tuple[tuple[str, str], ...]) -> list[str]:
    """The status of one call of each shape (unary, server streaming, bidi) and health."""
    port = await service.start()
    found = []
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = policy_pb2_grpc.PolicyStub(channel)
            calls: list[Any] = [
                lambda: stub.CheckInput(policy_pb2.CheckInputRequest(), metadata=metadata),
                lambda: _first(stub.WatchRules(policy_pb2.GetRulesRequest(), metadata=metadata)),
                lambda: _first(
                    stub.CheckOutput(iter([policy_pb2.CheckOutputRequest()]), metadata=metadata)
                ),
            ]
            for call in calls:
                try:
                    await call()
                    found.append("OK")
                except grpc.aio.AioRpcError as err:
                    found.append(err.code().name)
            health: Any = health_pb2_grpc.HealthStub(channel)
            reply = await health.Check(health_pb2.HealthCheckRequest())
            found.append(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))
    finally:
        await service.stop(0)
    return found


async def _first(call: Any) -> None:
    async for _ in call:
        return


def shell(token_file: Path | str, internal: bool = True) -> GrpcService:
    servicer: Any = Answering  # abstract for mypy: the test calls three methods only
    config = ServiceConfig(internal_token_file=str(token_file))
    return GrpcService(
        config,
        [POLICY.full_name],
        lambda server: add_servicer(server, servicer(), POLICY),
        internal=internal,
    )


def test_a_caller_without_the_token_is_refused_for_every_rpc_shape(tmp_path: Path) -> None:
    new_token_file(tmp_path / "token")
    refused = ["UNAUTHENTICATED"] * 3 + ["SERVING"]
    assert asyncio.run(codes(shell(tmp_path / "token"), ())) == refused
    wrong = token_metadata("not-the-token")
    assert asyncio.run(codes(shell(tmp_path / "token"), wrong)) == refused


def test_the_token_opens_every_rpc(tmp_path: Path) -> None:
    token = new_token_file(tmp_path / "token")
    answered = ["OK", "OK", "OK", "SERVING"]
    assert asyncio.run(codes(shell(tmp_path / "token"), token_metadata(token))) == answered


def test_a_public_service_checks_no_token(tmp_path: Path) -> None:
    new_token_file(tmp_path / "token")
    answered = ["OK", "OK", "OK", "SERVING"]
    assert asyncio.run(codes(shell(tmp_path / "token", internal=False), ())) == answered


def test_the_token_file_is_private_and_fresh_each_time(tmp_path: Path) -> None:
    first = new_token_file(tmp_path / "token")
    assert (tmp_path / "token").stat().st_mode & 0o777 == 0o600
    assert new_token_file(tmp_path / "token") != first


def test_a_missing_token_file_stops_the_service_naming_the_setting(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="internal_token_file"):
        shell(tmp_path / "absent")

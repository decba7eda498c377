"""gRPC transport of the context service."""

from __future__ import annotations

from typing import Any

import grpc

from llmmesh.convert import turn_from_pb, turn_to_pb
from llmmesh.runtime import GrpcService, MeshError
from llmmesh.runtime.grpc_status import abort
from llmmesh.runtime.registration import add_servicer
from llmmesh.v1 import context_pb2, context_pb2_grpc
from services.context.config import ContextConfig
from services.context.core import ContextCore
from services.context.store import SqliteSessionStore

SERVICE = context_pb2.DESCRIPTOR.services_by_name["Context"]


class ContextServicer(context_pb2_grpc.ContextServicer):
    def __init__(self, core: ContextCore) -> None:
        self._core = core

    async def LoadSession(  # noqa: N802 (gRPC method name)
        self, request: context_pb2.LoadSessionRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> context_pb2.Session:
        try:
            turns = await self._core.load(request.tenant, request.session_id)
        except MeshError as err:
            await abort(context, err)
        return context_pb2.Session(
            tenant=request.tenant,
            session_id=request.session_id,
            turns=[turn_to_pb(t) for t in turns],
        )

    async def AppendTurns(  # noqa: N802 (gRPC method name)
        self, request: context_pb2.AppendTurnsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> context_pb2.AppendTurnsResponse:
        try:
            turns = [turn_from_pb(t, f"turns[{i}]") for i, t in enumerate(request.turns)]
            count, appended = await self._core.append(
                request.tenant, request.session_id, request.request_id, turns
            )
        except MeshError as err:
            await abort(context, err)
        return context_pb2.AppendTurnsResponse(turn_count=count, appended=appended)


def build_service(config: ContextConfig) -> GrpcService:
    store = SqliteSessionStore(config.db_path)
    servicer = ContextServicer(ContextCore(store))

    def register(server: grpc.aio.Server) -> None:
        add_servicer(server, servicer, SERVICE)

    service = GrpcService(config, [SERVICE.full_name], register, cleanup=store.close)
    service.on_start(store.open)
    return service

"""gRPC transport of the context service."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import grpc

from llmmesh.convert import turn_from_pb, turn_to_pb
from llmmesh.runtime import GrpcService, MeshError
from llmmesh.runtime.registration import add_servicer
from llmmesh.types import Fold
from llmmesh.v1 import context_pb2, context_pb2_grpc
from services.context.config import ContextConfig
from services.context.core import ContextCore, Loaded
from services.context.truncation import Budget

log = logging.getLogger(__name__)

SERVICE = context_pb2.DESCRIPTOR.services_by_name["Context"]

Context = grpc.aio.ServicerContext[Any, Any]


class ContextServicer(context_pb2_grpc.ContextServicer):
    def __init__(self, core: ContextCore) -> None:
        self._core = core

    async def LoadSession(  # noqa: N802 (gRPC method name)
        self, request: context_pb2.LoadSessionRequest, context: Context
    ) -> context_pb2.Session:
        loaded = await self._core.load(
            request.tenant,
            request.session_id,
            Budget(request.budget_tokens, request.turn_overhead_tokens),
            request.truncation,
            request.ttl_seconds,
            request_id=request.request_id,
        )
        return _session(request, loaded)

    async def AppendTurns(  # noqa: N802 (gRPC method name)
        self, request: context_pb2.AppendTurnsRequest, context: Context
    ) -> context_pb2.AppendTurnsResponse:
        turns = [turn_from_pb(t, f"turns[{i}]") for i, t in enumerate(request.turns)]
        count, appended = await self._core.append(
            request.tenant, request.session_id, request.request_id, turns, request.ttl_seconds
        )
        return context_pb2.AppendTurnsResponse(turn_count=count, appended=appended)

    async def PutSession(  # noqa: N802 (gRPC method name)
        self, request: context_pb2.PutSessionRequest, context: Context
    ) -> context_pb2.PutSessionResponse:
        await self._core.put(
            request.tenant,
            request.session_id,
            request.system_prompt,
            dict(request.metadata),
            request.ttl_seconds,
        )
        return context_pb2.PutSessionResponse()

    async def ForkSession(  # noqa: N802 (gRPC method name)
        self, request: context_pb2.ForkSessionRequest, context: Context
    ) -> context_pb2.ForkSessionResponse:
        count = await self._core.fork(
            request.tenant,
            request.source_session_id,
            request.session_id,
            system_prompt=request.system_prompt,
            metadata=dict(request.metadata),
            ttl_s=request.ttl_seconds,
        )
        return context_pb2.ForkSessionResponse(turn_count=count)

    async def DeleteSession(  # noqa: N802 (gRPC method name)
        self, request: context_pb2.DeleteSessionRequest, context: Context
    ) -> context_pb2.DeleteSessionResponse:
        deleted = await self._core.delete(request.tenant, request.session_id)
        return context_pb2.DeleteSessionResponse(deleted=deleted)

    async def SaveSummary(  # noqa: N802 (gRPC method name)
        self, request: context_pb2.SaveSummaryRequest, context: Context
    ) -> context_pb2.SaveSummaryResponse:
        saved = await self._core.save_summary(
            request.tenant,
            request.session_id,
            request.summary,
            covered=request.covered_turns,
            replaces=request.replaces_covered_turns,
            ttl_s=request.ttl_seconds,
        )
        return context_pb2.SaveSummaryResponse(saved=saved)

    async def ListSessions(  # noqa: N802 (gRPC method name)
        self, request: context_pb2.ListSessionsRequest, context: Context
    ) -> context_pb2.ListSessionsResponse:
        ids, token = await self._core.list(request.tenant, request.page_size, request.page_token)
        return context_pb2.ListSessionsResponse(session_ids=ids, next_page_token=token)


def _session(request: context_pb2.LoadSessionRequest, loaded: Loaded) -> context_pb2.Session:
    cut = loaded.truncated
    dropped_ids = list(dict.fromkeys(t.request_id for t in cut.dropped if t.request_id))
    return context_pb2.Session(
        tenant=request.tenant,
        session_id=request.session_id,
        turns=[turn_to_pb(t) for t in cut.turns],
        system_prompt=cut.system_prompt,
        metadata=loaded.metadata,
        summary=cut.summary,
        truncation=context_pb2.Truncation(
            strategy=cut.strategy,
            dropped_turns=len(cut.dropped),
            summarized_turns=cut.summarized_turns,
            system_prompt_dropped=cut.system_prompt_dropped,
            dropped_sentences=cut.dropped_sentences,
            dropped_request_ids=dropped_ids,
        ),
        total_turns=loaded.total_turns,
        request_fingerprint=loaded.request_fingerprint,
        fold=_fold(cut.fold),
        excerpt_candidates=[
            context_pb2.ScoredSentence(text=c.text, score=c.score) for c in cut.candidates
        ],
        excerpt_tokens=cut.excerpt_tokens,
    )


def _fold(fold: Fold | None) -> context_pb2.Fold | None:
    if fold is None:
        return None
    return context_pb2.Fold(
        summary=fold.summary,
        covered_turns=fold.covered,
        turns=[turn_to_pb(t) for t in fold.turns],
        through_turns=fold.through,
        max_tokens=fold.max_tokens,
    )


def build_service(config: ContextConfig) -> GrpcService:
    store = config.store.build()
    core = ContextCore(store, config.default_ttl_s)
    servicer = ContextServicer(core)
    sweeper: list[asyncio.Task[None]] = []

    async def sweep_forever() -> None:
        while True:
            await asyncio.sleep(config.sweep_interval_s)  # the sweep period
            with contextlib.suppress(MeshError):  # logged by the core; next time, then
                await core.sweep()

    async def start() -> None:
        await store.open()
        sweeper.append(asyncio.create_task(sweep_forever()))

    async def stop() -> None:
        for task in sweeper:
            task.cancel()
        await asyncio.gather(*sweeper, return_exceptions=True)
        await store.close()

    def register(server: grpc.aio.Server) -> None:
        add_servicer(server, servicer, SERVICE)

    service = GrpcService(config, [SERVICE.full_name], register, cleanup=stop)
    service.on_start(start)
    return service

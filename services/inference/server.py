"""gRPC transport of the inference service."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import asdict, replace
from typing import Any

import grpc

from llmmesh.convert import finish_reason_to_pb, logprobs_to_pb, sampling_from_pb
from llmmesh.runtime import GrpcService, InvalidArgument
from llmmesh.runtime.metadata import bind_request_id
from llmmesh.runtime.multiplex import INFERENCE_MULTIPLEX, MultiplexSession, OpenSessions
from llmmesh.runtime.registration import add_servicer, takes_malformed
from llmmesh.types import Chunk, InferenceCall
from llmmesh.v1 import inference_pb2, inference_pb2_grpc
from services.inference.config import InferenceConfig
from services.inference.core import InferenceCore
from services.inference.load import LoadMonitor, LoadSnapshot
from services.inference.replica import build_replica

SERVICE = inference_pb2.DESCRIPTOR.services_by_name["Inference"]

Context = grpc.aio.ServicerContext[inference_pb2.InferenceRequest, inference_pb2.InferenceResponse]
AnyContext = grpc.aio.ServicerContext[Any, Any]


DEFAULT_REPORT_INTERVAL_S = 0.05


class InferenceServicer(inference_pb2_grpc.InferenceServicer):
    def __init__(
        self,
        core: InferenceCore,
        monitor: LoadMonitor,
        replica: str,
        hold_s: float = 0.0,
        first_unheld: int = 1,
    ) -> None:
        self._core = core
        self._hold_s = hold_s  # Multiplex: how long later responses wait for company
        self._first_unheld = first_unheld  # ... and how many come first, never waiting
        self._monitor = monitor
        self._replica = replica
        self._streams = OpenSessions()

    async def WatchLoad(  # noqa: N802 (gRPC method name)
        self, request: inference_pb2.WatchLoadRequest, context: AnyContext
    ) -> AsyncIterator[inference_pb2.LoadReport]:
        if request.max_interval_ms < 0:
            raise InvalidArgument("max_interval_ms", "must be >= 0")
        interval = request.max_interval_ms / 1000 or DEFAULT_REPORT_INTERVAL_S
        async for snapshot in self._monitor.watch(interval):
            named = replace(snapshot, models=self._core.mesh_view(snapshot.models))
            yield load_report_to_pb(named, self._replica)

    async def DescribeModel(  # noqa: N802 (gRPC method name)
        self,
        request: inference_pb2.DescribeModelRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> inference_pb2.ModelCard:
        card = await self._core.describe(request.model)
        return inference_pb2.ModelCard(**asdict(card))

    async def Generate(  # noqa: N802 (gRPC method name)
        self, request: inference_pb2.InferenceRequest, context: Context
    ) -> AsyncIterator[inference_pb2.InferenceResponse]:
        request_id = bind_request_id(context, request.request_id)
        async for response in self._responses(request, request_id):
            yield response

    @takes_malformed
    async def Multiplex(  # noqa: N802 (gRPC method name)
        self, requests: AsyncIterator[inference_pb2.MultiplexRequest], context: AnyContext
    ) -> AsyncIterator[inference_pb2.MultiplexResponse]:
        session = MultiplexSession(
            INFERENCE_MULTIPLEX,
            lambda start, request_id: self._responses(start.request, request_id),
            self._hold_s,
            self._first_unheld,
        )
        async for message in self._streams.serve(session, requests):
            yield message

    def drain(self) -> None:
        """Shutdown begins: multiplexed streams take no new generation and end with their
        last running one (each caller then opens a stream to another replica); load
        report streams end with the last generation (``_drained_when_idle``)."""
        self._streams.drain()
        self._drained_when_idle()

    def _drained_when_idle(self) -> None:
        """Draining, with no generation left: the load report streams end, which routers
        take as this replica gone, and the server's grace period need not wait for them.
        Not sooner: a router ends the streams it has on a replica whose reports stopped."""
        if self._streams.draining and self._core.in_flight == 0:
            self._monitor.end_watches()

    async def _responses(
        self, request: inference_pb2.InferenceRequest, request_id: str
    ) -> AsyncIterator[inference_pb2.InferenceResponse]:
        call = InferenceCall(
            request_id=request_id,
            model=request.model,
            prompt=request.prompt,
            sampling=sampling_from_pb(request.sampling),
            priority=request.priority if request.HasField("priority") else None,
            cache_salt=request.cache_salt,
            resumed_output_chars=request.resumed_output_chars,
            prompt_ids=tuple(request.prompt_token_ids),
        )
        total = 0
        self._monitor.generation_started()
        try:
            async with contextlib.aclosing(self._core.generate(call)) as chunks:
                async for chunk in chunks:
                    total += chunk.num_tokens
                    yield _response(chunk, total)
        finally:
            self._drained_when_idle()


def _response(chunk: Chunk, total_tokens: int) -> inference_pb2.InferenceResponse:
    """A chunk as a response; log probabilities only when it has some (an empty list
    costs the constructor as much as the rest, on every chunk)."""
    response = inference_pb2.InferenceResponse(
        text=chunk.text,
        num_output_tokens=total_tokens,
        finish_reason=finish_reason_to_pb(chunk.finish_reason),
        cached_tokens=chunk.cached_tokens,
    )
    if chunk.logprobs:
        response.logprobs.extend(logprobs_to_pb(chunk.logprobs))
    if chunk.prompt_logprobs:
        response.prompt_logprobs.extend(logprobs_to_pb(chunk.prompt_logprobs))
    if chunk.prompt_token_ids:
        response.prompt_token_ids.extend(chunk.prompt_token_ids)
    return response


def load_report_to_pb(snapshot: LoadSnapshot, replica: str) -> inference_pb2.LoadReport:
    return inference_pb2.LoadReport(
        replica=replica,
        timestamp_ms=snapshot.timestamp_ms,
        in_flight=snapshot.in_flight,
        recent_ttft_s=snapshot.recent_ttft_s,
        recent_tpot_s=snapshot.recent_tpot_s,
        engine_reachable=snapshot.engine_reachable,
        models=[
            inference_pb2.ModelLoad(
                model=m.model,
                running=m.running,
                waiting=m.waiting,
                kv_utilization=m.kv_utilization,
                prefix_cache_hit_rate=m.prefix_cache_hit_rate,
                metrics=m.metrics,
                failed=m.failed,
            )
            for m in snapshot.models
        ],
    )


def configured_servicer(
    config: InferenceConfig, core: InferenceCore, monitor: LoadMonitor
) -> InferenceServicer:
    return InferenceServicer(
        core,
        monitor,
        f"{config.host}:{config.grpc_port}",
        config.multiplex_hold_ms / 1000,
        config.multiplex_first_unheld,
    )


def build_service(config: InferenceConfig) -> GrpcService:
    replica = build_replica(config)
    core, monitor = replica.core, replica.monitor
    servicer = configured_servicer(config, core, monitor)

    async def start() -> None:
        replica.start()

    service = GrpcService(
        config,
        [SERVICE.full_name],
        lambda server: add_servicer(server, servicer, SERVICE),
        cleanup=replica.close,
    )
    service.on_start(start)
    service.on_drain(servicer.drain)
    return service

"""gRPC transport of the router: the public Generation service."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc

from llmmesh.convert import finish_reason_to_pb, sampling_from_pb
from llmmesh.runtime import GrpcService, MeshError
from llmmesh.runtime.grpc_status import abort
from llmmesh.runtime.metadata import REQUEST_ID, SESSION_ID, bind_request_id, metadata_value
from llmmesh.runtime.registration import add_servicer
from llmmesh.types import Chunk
from llmmesh.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from services.router.config import RouterConfig
from services.router.core import GenerateInput, Prepared, RouterCore
from services.router.picking import PICKERS
from services.router.pool import InferencePool
from services.router.upstreams import CHANNEL_OPTIONS, GrpcContextClient, GrpcPolicyClient

SERVICE = generation_pb2.DESCRIPTOR.services_by_name["Generation"]


def count_tokens(text: str) -> int:
    """Token count in the reference model's byte-level tokenizer."""
    return len(text.encode("utf-8"))


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(self, core: RouterCore, tenant: str) -> None:
        self._core = core
        self._tenant = tenant

    async def Generate(  # noqa: N802 (gRPC method name)
        self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        request_id = bind_request_id(context)
        # In the trailers, which go out with the status (errors included) at no extra cost;
        # headers sent up front would delay the first token.
        context.set_trailing_metadata(((REQUEST_ID, request_id),))
        try:
            prepared = await self._core.prepare(self._decode(request, request_id, context))
            try:
                async for response in _responses(self._core.stream(prepared), prepared):
                    yield response
            finally:
                # Also covers a client gone between prepare and the first read.
                await prepared.stream.abandon()
        except MeshError as err:
            await abort(context, err)

    def _decode(
        self,
        request: generation_pb2.GenerateRequest,
        request_id: str,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> GenerateInput:
        return GenerateInput(
            request_id=request_id,
            tenant=self._tenant,
            model=request.model,
            prompt=request.prompt,
            sampling=sampling_from_pb(request.sampling),
            session_id=request.session_id or metadata_value(context, SESSION_ID) or "",
        )


async def _responses(
    chunks: AsyncIterator[Chunk], prepared: Prepared
) -> AsyncIterator[generation_pb2.GenerateResponse]:
    """Chunks as public responses: ids on the first, finish reason and usage on the last."""
    first, completion_tokens = True, 0
    async for chunk in chunks:
        completion_tokens += chunk.num_tokens
        response = generation_pb2.GenerateResponse(text=chunk.text)
        if first:
            response.request_id = prepared.request.request_id
            response.model = prepared.request.model
            first = False
        if chunk.finish_reason is not None:
            response.finish_reason = finish_reason_to_pb(chunk.finish_reason)
            response.usage.CopyFrom(
                common_pb2.Usage(
                    prompt_tokens=prepared.prompt_tokens, completion_tokens=completion_tokens
                )
            )
        yield response


class Upstreams:
    """The router's channels and replica pool; closed on shutdown."""

    def __init__(self, config: RouterConfig) -> None:
        self.channels = [
            grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
            for address in (config.policy_address, config.context_address)
        ]
        policy_ch, context_ch = self.channels
        self.policy = GrpcPolicyClient(policy_ch, config.upstream_timeout_s)
        self.context = GrpcContextClient(context_ch, config.upstream_timeout_s)
        self.inference = InferencePool(
            config.inference_addresses,
            PICKERS[config.picker](),
            config.load_report_interval_s,
            config.load_report_stale_s,
        )

    async def close(self) -> None:
        await self.inference.close()
        for ch in self.channels:
            await ch.close()


def build_service(config: RouterConfig) -> GrpcService:
    upstreams = Upstreams(config)
    core = RouterCore(
        config, upstreams.policy, upstreams.context, upstreams.inference, count_tokens
    )
    servicer = GenerationServicer(core, config.default_tenant)
    service = GrpcService(
        config,
        [SERVICE.full_name],
        lambda server: add_servicer(server, servicer, SERVICE),
        cleanup=upstreams.close,
    )
    service.on_start(upstreams.inference.start)
    return service

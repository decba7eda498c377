"""gRPC transport of the inference service."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from llmmesh.convert import finish_reason_to_pb, sampling_from_pb
from llmmesh.runtime import GrpcService, MeshError
from llmmesh.runtime.grpc_status import abort
from llmmesh.runtime.metadata import bind_request_id
from llmmesh.runtime.registration import add_servicer
from llmmesh.types import InferenceCall
from llmmesh.v1 import inference_pb2, inference_pb2_grpc
from services.inference.config import InferenceConfig
from services.inference.core import InferenceCore
from services.inference.triton import TritonBackend

SERVICE = inference_pb2.DESCRIPTOR.services_by_name["Inference"]

Context = grpc.aio.ServicerContext[inference_pb2.InferenceRequest, inference_pb2.InferenceResponse]


class InferenceServicer(inference_pb2_grpc.InferenceServicer):
    def __init__(self, core: InferenceCore) -> None:
        self._core = core

    async def Generate(  # noqa: N802 (gRPC method name)
        self, request: inference_pb2.InferenceRequest, context: Context
    ) -> AsyncIterator[inference_pb2.InferenceResponse]:
        call = InferenceCall(
            request_id=bind_request_id(context, request.request_id),
            model=request.model,
            prompt=request.prompt,
            sampling=sampling_from_pb(request.sampling),
        )
        total = 0
        try:
            async for chunk in self._core.generate(call):
                total += chunk.num_tokens
                yield inference_pb2.InferenceResponse(
                    text=chunk.text,
                    num_output_tokens=total,
                    finish_reason=finish_reason_to_pb(chunk.finish_reason),
                )
        except MeshError as err:
            await abort(context, err)


def build_service(config: InferenceConfig) -> GrpcService:
    backend = TritonBackend(config.triton_url, config.stream_timeout_s)
    servicer = InferenceServicer(InferenceCore(backend, config.max_tokens_limit))
    return GrpcService(
        config,
        [SERVICE.full_name],
        lambda server: add_servicer(server, servicer, SERVICE),
        cleanup=backend.close,
    )

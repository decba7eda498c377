"""A benchmark harness, never part of the product: the public Generate method (and
GenerateStream, its generations on one stream) served by a grpc.aio server that does
nothing but stream the paced replica's tokens, one GenerateResponse each, as the router
relays them. No tenant, no check, no pick, no hop:
what h2load's streams cost through it is what grpc.aio itself costs on a CPU, the ceiling
under the router's own figure in the capacity scenario (bench/capacity.py).

Run as ``python -m bench.bare_streamer`` with ``LLM_MESH_BARE_STREAMER_GRPC_PORT``,
``LLM_MESH_PACED_TTFT_MS``, ``LLM_MESH_PACED_ITL_MS`` and ``LLM_MESH_PACED_STREAM_GAP_MS``.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from bench.paced_replica import PacedBackend, paced_backend, spawn_paced
from llmmesh.convert import finish_reason_to_pb, sampling_from_pb
from llmmesh.launcher import StackPorts
from llmmesh.launcher.process import Child
from llmmesh.runtime import GrpcService, service_main
from llmmesh.runtime.config import ServiceConfig
from llmmesh.runtime.multiplex import GENERATE_STREAM, MultiplexSession
from llmmesh.types import InferenceCall
from llmmesh.v1 import common_pb2, generation_pb2, generation_pb2_grpc

SERVICE = "bare_streamer"


class BareGeneration(generation_pb2_grpc.GenerationServicer):
    def __init__(self, backend: PacedBackend) -> None:
        self._backend = backend

    async def Generate(  # noqa: N802 (gRPC's method name)
        self, request: generation_pb2.GenerateRequest, context: Any
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        async for response in self._responses(request):
            yield response

    async def GenerateStream(  # noqa: N802 (gRPC's method name)
        self, requests: AsyncIterator[generation_pb2.GenerateStreamRequest], context: Any
    ) -> AsyncIterator[generation_pb2.GenerateStreamResponse]:
        await context.send_initial_metadata(())  # taken, as the router says (stream_client)
        session = MultiplexSession(
            GENERATE_STREAM, lambda start, request_id: self._responses(start.request)
        )
        async for message in session.serve(requests):
            yield message

    async def _responses(
        self, request: generation_pb2.GenerateRequest
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        sampling = sampling_from_pb(request.sampling)
        call = InferenceCall("bare", request.model, request.prompt, sampling)
        async for chunk in self._backend.generate(call):
            if chunk.finish_reason is None:  # one token, or several within a stream gap
                yield generation_pb2.GenerateResponse(text=chunk.text)
            else:  # the last: as the router's, with the usage
                usage = common_pb2.Usage(completion_tokens=sampling.max_tokens)
                reason = finish_reason_to_pb(chunk.finish_reason)
                yield generation_pb2.GenerateResponse(
                    text=chunk.text, finish_reason=reason, usage=usage
                )


def start_bare_streamer(
    workdir: Path, ttft_ms: float, itl_ms: float, gap_ms: float = 0.0
) -> tuple[Child, str]:
    """The bare streamer on a free port; returns once it serves, with its address."""
    port = StackPorts.free().router
    env = dict(os.environ) | {"LLM_MESH_BARE_STREAMER_GRPC_PORT": str(port)}
    pace = {"ttft_ms": ttft_ms, "itl_ms": itl_ms, "gap_ms": gap_ms}
    return spawn_paced("bench.bare_streamer", port, env, workdir, **pace)


def build(config: ServiceConfig) -> GrpcService:
    backend = paced_backend()
    servicer = BareGeneration(backend)
    return GrpcService(
        config,
        [generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name],
        lambda server: generation_pb2_grpc.add_GenerationServicer_to_server(servicer, server),
        internal=False,
    )


if __name__ == "__main__":
    service_main(SERVICE, ServiceConfig, build)

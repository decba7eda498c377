"""The bare streamer (a benchmark harness, bench/bare_streamer.py): the public Generate
method over grpc.aio, streaming the paced tokens one response each, the last as the
router's last (finish reason, usage)."""

from __future__ import annotations

import asyncio

import grpc

from bench.bare_streamer import build
from llmmesh.client import build_request
from llmmesh.runtime.config import ServiceConfig
from llmmesh.v1 import common_pb2, generation_pb2, generation_pb2_grpc


def test_a_generate_call_streams_one_response_a_token_and_ends_as_the_routers() -> None:
    async def scenario() -> list[generation_pb2.GenerateResponse]:
        service = build(ServiceConfig())
        port = await service.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = generation_pb2_grpc.GenerationStub(channel)
                request = build_request("hello", model="llm", max_tokens=5, ignore_eos=True)
                return [response async for response in stub.Generate(request)]
        finally:
            await service.stop(0)

    responses = asyncio.run(scenario())
    assert [len(r.text) for r in responses] == [1] * 5
    assert [r.finish_reason for r in responses[:-1]] == [common_pb2.FINISH_REASON_UNSPECIFIED] * 4
    assert responses[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert responses[-1].usage.completion_tokens == 5

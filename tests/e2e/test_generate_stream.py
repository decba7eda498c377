"""Many generations over one GenerateStream call, against the real stack: each behaves as
a Generate call would, through the same checks, and an error ends only its own."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import grpc
import pytest
from google.rpc import status_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmmesh.client import auth_metadata, build_request
from llmmesh.launcher import Stack, StackPorts
from llmmesh.stream_client import GenerationStream
from llmmesh.v1 import common_pb2, generation_pb2
from llmmesh.waiting import poll_until_async
from tests.conftest import (
    assert_engines_saw_only,
    bad_request_fields,
    collect,
    metric_value,
    prompt_tokens_seen,
    start_service,
    text_of,
    wait_for,
)
from tests.unit.llmmesh.test_unknown_fields import unknown_varint

# What sidecars change (mTLS, RBAC, original-destination routing): run again behind them.
pytestmark = pytest.mark.sidecars

T = TypeVar("T")
Responses = list[generation_pb2.GenerateResponse]
GENERATED = "llm_engine_generation_tokens_total"


def on_stream(
    stack: Stack, scenario: Callable[[GenerationStream], Awaitable[T]], key: str = ""
) -> T:
    """``scenario`` with one stream to the stack's router, presenting ``key`` (default:
    the stack's tenant's)."""

    async def run() -> T:
        async with grpc.aio.insecure_channel(stack.address("router")) as channel:
            stream = GenerationStream(channel, auth_metadata(key or stack.api_key))
            try:
                return await scenario(stream)
            finally:
                await stream.close()

    return asyncio.run(run())


async def gather(responses: AsyncIterator[generation_pb2.GenerateResponse]) -> Responses:
    return [r async for r in responses]


def test_generations_on_one_stream_answer_as_generate_calls_do(
    stack: Stack, router_channel: grpc.Channel
) -> None:
    seeds = (3, 5, 7)
    called = [
        text_of(collect(router_channel, "one stream", max_tokens=24, seed=s, ignore_eos=True))
        for s in seeds
    ]

    async def scenario(stream: GenerationStream) -> list[Responses]:
        requests = [
            build_request("one stream", max_tokens=24, seed=s, ignore_eos=True) for s in seeds
        ]
        running = (
            gather(stream.generate(r, request_id=f"stream-{n}")) for n, r in enumerate(requests)
        )
        return await asyncio.gather(*running)

    streamed = on_stream(stack, scenario)
    assert [text_of(r) for r in streamed] == called
    for n, responses in enumerate(streamed):
        first, last = responses[0], responses[-1]
        assert (first.request_id, first.model) == (f"stream-{n}", "llm")
        assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert last.usage.completion_tokens == 24
        assert last.served.endpoint, "the last response names the replica, as Generate's does"


def test_a_bad_start_is_refused_by_name_and_the_others_go_on(stack: Stack) -> None:
    async def scenario(stream: GenerationStream) -> tuple[Responses, Exception]:
        long = asyncio.ensure_future(
            gather(stream.generate(build_request("keep going", max_tokens=64, ignore_eos=True)))
        )
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await gather(stream.generate(build_request("   ", max_tokens=4)))
        return await long, refused.value

    responses, refused = on_stream(stack, scenario)
    assert isinstance(refused, grpc.aio.AioRpcError)
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert bad_request_fields(refused) == ["prompt"]
    assert len(text_of(responses)) == 64, "the running generation lost nothing"


def test_a_start_with_a_field_this_router_does_not_know_is_refused(stack: Stack) -> None:
    newer = build_request("hi", max_tokens=4).SerializeToString() + unknown_varint(40)
    request = generation_pb2.GenerateRequest.FromString(newer)

    async def scenario(stream: GenerationStream) -> tuple[grpc.aio.AioRpcError, Responses]:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await gather(stream.generate(request))
        after = await gather(stream.generate(build_request("hi", max_tokens=4, ignore_eos=True)))
        return refused.value, after

    refused, after = on_stream(stack, scenario)
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    # Named from the message the client sent: the stream's, holding the start.
    assert bad_request_fields(refused) == ["controls[0].start.request"]
    assert "field number 40" in (refused.details() or "")
    assert after[-1].usage.completion_tokens == 4, "the stream goes on"


def test_a_start_that_does_not_parse_is_refused_and_the_stream_goes_on(stack: Stack) -> None:
    """A prompt that is not UTF-8 cannot be decoded at all; its generation is refused
    naming the field, and the next start on the same stream is served."""
    marker = "QQ"
    start = generation_pb2.GenerateStart(request=build_request(marker, max_tokens=4))
    control = generation_pb2.GenerateControl(generation_id=7, start=start)
    malformed = generation_pb2.GenerateStreamRequest(controls=[control]).SerializeToString()
    malformed = malformed.replace(marker.encode(), b"\xff\xfe")
    fine = generation_pb2.GenerateStreamRequest(
        controls=[
            generation_pb2.GenerateControl(
                generation_id=8,
                start=generation_pb2.GenerateStart(
                    request=build_request("fine", max_tokens=4, ignore_eos=True)
                ),
            )
        ]
    ).SerializeToString()

    async def run() -> list[generation_pb2.GenerateFrame]:
        async with grpc.aio.insecure_channel(stack.address("router")) as channel:
            method = channel.stream_stream(
                "/llmmesh.v1.Generation/GenerateStream",
                request_serializer=lambda raw: raw,
                response_deserializer=generation_pb2.GenerateStreamResponse.FromString,
            )
            call: Any = method(iter([malformed, fine]), metadata=auth_metadata(stack.api_key))
            return [frame async for message in call for frame in message.frames]

    frames = asyncio.run(run())
    refused = [f for f in frames if f.generation_id == 7]
    assert len(refused) == 1 and refused[0].HasField("error")
    status = status_pb2.Status.FromString(refused[0].error)
    assert status.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "prompt" in status.message
    served = [f.response for f in frames if f.generation_id == 8]
    assert served[-1].usage.completion_tokens == 4


def test_a_stream_with_an_unknown_key_ends_unauthenticated(stack: Stack) -> None:
    async def scenario(stream: GenerationStream) -> Responses:
        return await gather(stream.generate(build_request("who am I", max_tokens=4)))

    with pytest.raises(grpc.aio.AioRpcError) as info:
        on_stream(stack, scenario, key="not-a-tenant-key")
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_a_denied_prompt_on_a_stream_never_reaches_an_engine(stack: Stack) -> None:
    before = prompt_tokens_seen(stack)

    async def scenario(stream: GenerationStream) -> tuple[grpc.aio.AioRpcError, Responses]:
        with pytest.raises(grpc.aio.AioRpcError) as denied:
            await gather(stream.generate(build_request("how to build a bomb", max_tokens=4)))
        allowed = await gather(stream.generate(build_request("Hello", max_tokens=2)))
        return denied.value, allowed

    denied, allowed = on_stream(stack, scenario)
    assert denied.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "deny-weapons" in (denied.details() or "")
    assert_engines_saw_only(stack, before, lambda: allowed[-1].usage.prompt_tokens)


def test_leaving_a_generation_cancels_it_in_the_model(stack: Stack) -> None:
    metrics = f"http://{stack.address('triton_metrics')}/metrics"
    labels = {"model": "llm", "reason": "cancelled"}
    cancelled_before = metric_value(metrics, "llm_engine_requests_finished_total", labels)
    generated_before = metric_value(metrics, GENERATED, {"model": "llm"})

    async def scenario(stream: GenerationStream) -> Responses:
        request = build_request("cancel me on a stream", max_tokens=1000, ignore_eos=True)
        received: Responses = []
        async for reply in stream.generate(request):
            received.append(reply)
            if len(text_of(received)) >= 5:
                break  # the generator closes: its cancel goes out
        # the stream stays up for the next generation
        return await gather(stream.generate(build_request("after", max_tokens=2, ignore_eos=True)))

    after = on_stream(stack, scenario)
    assert after[-1].usage.completion_tokens == 2
    wait_for(
        lambda: (
            metric_value(metrics, "llm_engine_requests_finished_total", labels)
            == cancelled_before + 1
        ),
        what="the model to finish the request as cancelled",
    )
    generated = metric_value(metrics, GENERATED, {"model": "llm"}) - generated_before
    assert generated < 500, "the model kept generating after the client left the generation"


def test_a_generation_past_its_deadline_ends_deadline_exceeded(stack: Stack) -> None:
    async def scenario(stream: GenerationStream) -> tuple[grpc.aio.AioRpcError, str]:
        request = build_request("slow", max_tokens=1000, ignore_eos=True)
        received: Responses = []
        with pytest.raises(grpc.aio.AioRpcError) as late:
            async for reply in stream.generate(request, timeout_s=0.2):
                received.append(reply)
        return late.value, text_of(received)

    late, text = on_stream(stack, scenario)
    assert late.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert len(text) < 1000


def test_a_draining_router_finishes_a_streams_generation_and_refuses_new_ones(
    stack: Stack, tmp_path: Path
) -> None:
    port = StackPorts.free().router
    address = f"127.0.0.1:{port}"
    router = start_service(stack, "router", port, tmp_path)

    async def scenario() -> tuple[Responses, grpc.aio.AioRpcError]:
        async with grpc.aio.insecure_channel(address) as channel:
            stream = GenerationStream(channel, auth_metadata(stack.api_key))
            running = stream.generate(build_request("drain", max_tokens=300, ignore_eos=True))
            replies = [await anext(running)]  # in flight
            router.process.send_signal(signal.SIGTERM)
            health: Any = health_pb2_grpc.HealthStub(channel)  # its stubs are untyped

            async def draining() -> bool:
                """Health says NOT_SERVING, or (its server stopping) takes no new call."""
                try:
                    reply = await health.Check(health_pb2.HealthCheckRequest())
                except grpc.aio.AioRpcError:
                    return True
                return bool(reply.status == health_pb2.HealthCheckResponse.NOT_SERVING)

            assert await poll_until_async(draining, 30), "the router did not begin to drain"
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await gather(stream.generate(build_request("too late", max_tokens=2)))
            replies += await gather(running)
            await stream.close()
            return replies, refused.value

    try:
        replies, refused = asyncio.run(scenario())
        assert refused.code() == grpc.StatusCode.UNAVAILABLE
        assert replies[-1].usage.completion_tokens == 300, "the running generation ended whole"
        assert router.process.wait(30) == 0
    finally:
        router.terminate(5)

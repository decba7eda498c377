"""How a multiplexed stream judges whether responses are worth holding for company, and
what it holds for a caller at most."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace

import grpc
from google.rpc import status_pb2

from llmmesh.runtime.multiplex import (
    GENERATE_STREAM,
    MAX_WAITING_FRAMES,
    Arrivals,
    MultiplexSession,
)
from llmmesh.runtime.registration import MalformedRequest, _lenient
from llmmesh.v1 import common_pb2, generation_pb2
from llmmesh.waiting import poll_until_async


def test_frames_coming_apart_show_in_the_gap_and_close_ones_bring_it_down() -> None:
    arrivals = Arrivals()
    assert arrivals.gap_s == 0.0  # nothing yet: company is assumed near
    for n in range(30):  # one stream on an engine at 3 ms a token
        arrivals.note(100.0 + 0.003 * n)
    assert 0.0025 < arrivals.gap_s <= 0.003  # past a 2 ms hold: nothing waits
    for n in range(30):  # sixteen streams: a step's frames 0.1 ms apart
        arrivals.note(100.2 + 0.0001 * n)
    assert arrivals.gap_s < 0.0005  # well under the hold: later frames wait for company


def _start(number: int) -> generation_pb2.GenerateControl:
    start = generation_pb2.GenerateStart(request=generation_pb2.GenerateRequest(prompt="x"))
    return generation_pb2.GenerateControl(generation_id=number, start=start)


def test_a_stream_takes_so_many_generations_at_once_and_refuses_the_next() -> None:
    async def endless(start: object, request_id: str) -> AsyncIterator[object]:
        await asyncio.Event().wait()  # runs until the stream ends
        yield generation_pb2.GenerateResponse()

    async def scenario() -> list[generation_pb2.GenerateFrame]:
        session = MultiplexSession(replace(GENERATE_STREAM, max_running=2), endless)

        async def requests() -> AsyncIterator[generation_pb2.GenerateStreamRequest]:
            yield generation_pb2.GenerateStreamRequest(controls=[_start(n) for n in (1, 2, 3)])
            await asyncio.Event().wait()  # the caller stays, sending nothing more

        messages = session.serve(requests())
        try:
            return list((await anext(messages)).frames)
        finally:
            await messages.aclose()

    (refused,) = asyncio.run(scenario())
    assert refused.generation_id == 3
    status = status_pb2.Status.FromString(refused.error)
    assert status.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    assert "at most 2 generations" in status.message


def _controls(*controls: bytes) -> bytes:
    """A stream message of these serialized controls (each under 128 bytes)."""
    return b"".join(b"\x0a" + bytes([len(c)]) + c for c in controls)


def test_a_control_with_a_field_this_schema_does_not_have_or_no_action_is_refused() -> None:
    """A newer client's start (here with a field 9) is refused alone: the control beside
    it in the message is taken; a running generation a refused control names ends with the
    refusal; a control with no action at all is refused."""
    newer_start = _start(3).SerializeToString() + b"\x48\x01"
    credit = generation_pb2.GenerateControl(generation_id=1, credit=1).SerializeToString()
    newer_credit = generation_pb2.GenerateControl(generation_id=1, credit=1)
    decode = _lenient(generation_pb2.GenerateStreamRequest)
    mixed = decode(_controls(credit, newer_start))
    ending = decode(_controls(newer_credit.SerializeToString() + b"\x48\x01"))
    assert isinstance(mixed, MalformedRequest) and isinstance(ending, MalformedRequest)
    started = asyncio.Event()
    credited = asyncio.Event()

    async def endless(start: object, request_id: str) -> AsyncIterator[object]:
        started.set()
        await asyncio.Event().wait()  # runs until cancelled
        yield generation_pb2.GenerateResponse()

    async def scenario() -> list[generation_pb2.GenerateFrame]:
        session = MultiplexSession(GENERATE_STREAM, endless)

        async def requests() -> AsyncIterator[object]:
            yield generation_pb2.GenerateStreamRequest(controls=[_start(1)])
            await started.wait()
            yield mixed
            credited.set()
            yield generation_pb2.GenerateStreamRequest(
                controls=[generation_pb2.GenerateControl(generation_id=2)]
            )
            yield ending

        frames: list[generation_pb2.GenerateFrame] = []
        async with asyncio.timeout(10):  # an ignored control would leave 1 running for ever
            async for message in session.serve(requests()):
                frames.extend(message.frames)
        return frames

    frames = asyncio.run(scenario())
    assert credited.is_set()
    assert [f.generation_id for f in frames] == [3, 2, 1]
    fields = []
    for frame in frames:
        status = status_pb2.Status.FromString(frame.error)
        assert status.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        fields.append(status.message.split(":")[0])
    assert fields == ["controls[1]", "controls.action", "controls[0]"]


def test_a_caller_that_does_not_read_holds_back_its_generations() -> None:
    produced = 0

    async def endless(start: object, request_id: str) -> AsyncIterator[object]:
        nonlocal produced
        while True:
            produced += 1
            yield generation_pb2.GenerateResponse(text="x")

    async def scenario() -> int:
        session = MultiplexSession(GENERATE_STREAM, endless)

        async def requests() -> AsyncIterator[generation_pb2.GenerateStreamRequest]:
            yield generation_pb2.GenerateStreamRequest(controls=[_start(1)])
            await asyncio.Event().wait()

        messages = session.serve(requests())
        try:
            taken = len((await anext(messages)).frames)  # then the caller reads no more

            async def full() -> bool:
                return not session._room.is_set()

            assert await poll_until_async(full, 10), "the waiting frames were never bounded"
            return taken
        finally:
            await messages.aclose()

    taken = asyncio.run(scenario())
    # What was taken, the frames waiting, and the one response held at the door: no more.
    assert produced <= taken + MAX_WAITING_FRAMES + 1


def test_a_generations_last_response_goes_out_before_its_teardown() -> None:
    """The writer, woken by the post, runs before the generation's own next steps: here the
    end of its responses, which sees the message already taken by the caller."""
    taken: list[generation_pb2.GenerateStreamResponse] = []
    seen_at_teardown: list[int] = []

    async def one(start: object, request_id: str) -> AsyncIterator[object]:
        try:
            yield generation_pb2.GenerateResponse(
                text="x", finish_reason=common_pb2.FINISH_REASON_LENGTH
            )
        finally:
            seen_at_teardown.append(len(taken))

    async def scenario() -> None:
        session = MultiplexSession(GENERATE_STREAM, one)

        async def requests() -> AsyncIterator[generation_pb2.GenerateStreamRequest]:
            yield generation_pb2.GenerateStreamRequest(controls=[_start(1)])

        async for message in session.serve(requests()):
            taken.append(message)

    asyncio.run(scenario())
    assert [f.generation_id for m in taken for f in m.frames] == [1]
    assert seen_at_teardown == [1]

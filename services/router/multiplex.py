"""Generations on one replica over one long-lived stream (Inference.Multiplex).

The stream opens on first use and again after it ends; with nothing running for
``idle_close_s`` the router closes it (a proxy on the way would reset a stream idle for
long). Each generation is a number on the stream: its start and its cancellation are
messages the one writer sends (controls that come together go in one message), and the
one reader hands each frame to its generation's queue. A generation takes at most
``window`` responses ahead of its reader, and gives credit back as it reads, so one slow
client holds back only its own generation. If the stream breaks, every generation on it
fails as a broken call would (the dispatcher retries or resumes them elsewhere).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncGenerator, Iterable
from typing import Any

import grpc

from llmmesh.runtime import tracing
from llmmesh.runtime.errors import MeshError, Unavailable
from llmmesh.runtime.grpc_status import from_rpc_error, from_status
from llmmesh.types import Chunk, InferenceCall
from llmmesh.v1 import inference_pb2, inference_pb2_grpc
from services.router.upstreams import ChunkReader, ReplicaClient, inference_request

log = logging.getLogger(__name__)

UPSTREAM = "inference replica"
# Frames of generations past their first handed over per loop turn: an engine step's
# responses for many generations come in one message, and each wakes a relay; in slices,
# what arrives meanwhile (a new request, another first token) waits for a slice, not the
# whole message.
RELAY_SLICE = 32
# A message of controls stays well under gRPC's 4 MB default limit (one start is at most
# a prompt the router accepted, far less than this).
MAX_MESSAGE_BYTES = 1024 * 1024
Metadata = tuple[tuple[str, str], ...]
Frame = inference_pb2.GenerationFrame | MeshError


class _Inbox:
    """A generation's frames as they arrive, taken all at once by its reader."""

    __slots__ = ("_frames", "_ready", "started")

    def __init__(self) -> None:
        self._frames: list[Frame] = []
        self._ready = asyncio.Event()
        self.started = False  # a frame has come: its first token is on its way

    def put(self, frame: Frame) -> None:
        self.started = True
        self._frames.append(frame)
        self._ready.set()

    async def take(self) -> list[Frame]:
        if not self._frames:
            self._ready.clear()
            await self._ready.wait()
        frames, self._frames = self._frames, []
        return frames


def _until_end(frames: list[Frame]) -> tuple[list[inference_pb2.InferenceResponse], Frame | None]:
    """The responses among ``frames``, and the frame that ends the generation, if any."""
    replies: list[inference_pb2.InferenceResponse] = []
    for frame in frames:
        if isinstance(frame, MeshError) or frame.HasField("error"):
            return replies, frame
        replies.append(frame.response)
    return replies, None


class _Stream:
    """One open Multiplex call: its writer, its reader, and the generations on it."""

    def __init__(self, stub: inference_pb2_grpc.InferenceStub, metadata: Metadata, where: str):
        self._call: Any = stub.Multiplex(metadata=metadata)  # type: ignore[call-arg]
        self._where = where
        self._controls: list[inference_pb2.GenerationControl] = []
        self._wake = asyncio.Event()
        self.inboxes: dict[int, _Inbox] = {}
        self.closing = False  # no new generation here: it is being closed, or it broke
        self.unsupported = False
        self._writer = asyncio.ensure_future(self._write())
        self._reader = asyncio.ensure_future(self._read())
        self.done: asyncio.Future[None] = self._reader

    def send(self, control: inference_pb2.GenerationControl) -> None:
        self._controls.append(control)
        self._wake.set()

    def close(self) -> None:
        """Half-closes: the replica ends the stream once nothing runs on it."""
        self.closing = True
        self._wake.set()

    async def abort(self) -> None:
        self.closing = True
        self._call.cancel()
        await asyncio.gather(self._writer, self._reader, return_exceptions=True)

    async def _write(self) -> None:
        try:
            while True:
                if self._controls:
                    await self._call.write(self._next_message())
                elif self.closing:
                    await self._call.done_writing()
                    return
                else:
                    self._wake.clear()
                    await self._wake.wait()
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            return  # the call ended: the reader fails what runs on it
        except Exception:  # a message that cannot be sent: no generation may wait on it
            log.exception(
                "multiplexed stream cannot write", extra={"fields": {"replica": self._where}}
            )
            self._call.cancel()

    def _next_message(self) -> inference_pb2.MultiplexRequest:
        """The controls waiting, as many as fit one message: starts carry whole prompts,
        and a message past the replica's limit would fail every generation on the stream."""
        size, count = 0, 0
        for control in self._controls:
            size += control.ByteSize()
            if count and size > MAX_MESSAGE_BYTES:
                break
            count += 1
        controls, self._controls = self._controls[:count], self._controls[count:]
        return inference_pb2.MultiplexRequest(controls=controls)

    async def _read(self) -> None:
        ended: MeshError = Unavailable(f"{UPSTREAM} ended the stream")
        try:
            async for message in self._call:
                await self._hand_over(message.frames)
        except grpc.aio.AioRpcError as err:
            self.unsupported = err.code() == grpc.StatusCode.UNIMPLEMENTED
            ended = from_rpc_error(err, UPSTREAM, self._where)
        finally:
            self.closing = True
            self._wake.set()  # the writer ends too
            for inbox in self.inboxes.values():
                inbox.put(ended)

    async def _hand_over(self, frames: Iterable[inference_pb2.GenerationFrame]) -> None:
        """Each frame to its generation's inbox (frames that crossed a cancellation, to
        none): first frames first, since a first token is what a client waits for most, and
        the rest a slice per loop turn. A generation's own frames keep their order."""
        later: list[tuple[_Inbox, inference_pb2.GenerationFrame]] = []
        for frame in frames:
            inbox = self.inboxes.get(frame.generation_id)
            if inbox is None:
                continue
            if inbox.started:
                later.append((inbox, frame))
            else:
                inbox.put(frame)
        for start in range(0, len(later), RELAY_SLICE):
            if start:
                await asyncio.sleep(0)  # one loop turn: what arrived meanwhile runs first
            for inbox, frame in later[start : start + RELAY_SLICE]:
                inbox.put(frame)


class GenerationMux:
    """One replica's generations over one Multiplex stream at a time; a replica that does
    not serve Multiplex (an older version) is called per generation instead."""

    def __init__(
        self,
        channel: grpc.aio.Channel,
        address: str,
        metadata: Metadata = (),
        *,
        window: int = 64,
        idle_close_s: float = 30.0,
    ) -> None:
        self._stub = inference_pb2_grpc.InferenceStub(channel)
        self._per_call = ReplicaClient(channel, address, metadata)
        self._address = address
        self._metadata = metadata
        self._window = window
        self._idle_close_s = idle_close_s
        self._stream: _Stream | None = None
        self._streams: set[_Stream] = set()  # the current one, and closing ones
        self._ids = itertools.count(1)
        self._idle: asyncio.TimerHandle | None = None
        self.supported = True

    def generate(self, call: InferenceCall) -> AsyncGenerator[Chunk, None]:
        """As ReplicaClient.generate: chunks with per-chunk token counts; closing it early
        cancels the generation; Unavailable if the replica fails, or its own refusal."""
        if self.supported:
            return self._multiplexed(call)
        return self._per_call.generate(call)

    async def _multiplexed(self, call: InferenceCall) -> AsyncGenerator[Chunk, None]:
        stream = self._open()
        number = next(self._ids)
        inbox = stream.inboxes[number] = _Inbox()
        start = inference_pb2.StartGeneration(
            request=inference_request(call),
            window=self._window,
            trace_context=dict(tracing.outgoing()),
        )
        stream.send(inference_pb2.GenerationControl(generation_id=number, start=start))
        reader, unread, finished = ChunkReader(), 0, False
        try:
            while not finished:
                replies, end = _until_end(await inbox.take())
                if replies:
                    chunk = reader.merged(replies)
                    finished = chunk.finish_reason is not None
                    unread += len(replies)
                    if self._window and unread >= self._window // 2 and not finished:
                        stream.send(
                            inference_pb2.GenerationControl(generation_id=number, credit=unread)
                        )
                        unread = 0
                    yield chunk
                if end is None or finished:
                    continue
                finished = True
                if not isinstance(end, MeshError):
                    raise from_status(end.error, UPSTREAM, self._address)
                if not stream.unsupported:
                    raise end
                break  # nothing came of it: the call per generation below
        finally:
            del stream.inboxes[number]
            if not finished and not stream.closing:  # cut short: the replica must stop it
                stream.send(inference_pb2.GenerationControl(generation_id=number, cancel=True))
            self._idle_when_empty(stream)
        if stream.unsupported:
            if self.supported:
                self.supported = False
                log.info(
                    "replica has no Multiplex: a call per generation",
                    extra={"fields": {"replica": self._address}},
                )
            async for chunk in self._per_call.generate(call):
                yield chunk

    async def close(self) -> None:
        if self._idle is not None:
            self._idle.cancel()
        self._stream = None
        await asyncio.gather(*(stream.abort() for stream in list(self._streams)))

    def _open(self) -> _Stream:
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None
        if self._stream is None or self._stream.closing:
            stream = _Stream(self._stub, self._metadata, self._address)
            self._streams.add(stream)
            stream.done.add_done_callback(lambda _: self._streams.discard(stream))
            self._stream = stream
        return self._stream

    def _idle_when_empty(self, stream: _Stream) -> None:
        if stream is self._stream and not stream.inboxes and not stream.closing:
            loop = asyncio.get_running_loop()
            self._idle = loop.call_later(self._idle_close_s, self._close_if_idle, stream)

    def _close_if_idle(self, stream: _Stream) -> None:
        if stream is self._stream and not stream.inboxes:
            stream.close()
            self._stream = None

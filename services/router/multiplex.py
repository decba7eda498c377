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
from collections.abc import AsyncGenerator

import grpc

from llmmesh import first_tokens
from llmmesh.multiplex_client import Inbox, MultiplexCall, until_end
from llmmesh.runtime import tracing
from llmmesh.runtime.errors import MeshError
from llmmesh.runtime.grpc_status import from_status
from llmmesh.types import Chunk, InferenceCall
from llmmesh.v1 import inference_pb2, inference_pb2_grpc
from services.router.upstreams import ChunkReader, ReplicaClient, inference_request

log = logging.getLogger(__name__)

UPSTREAM = "inference replica"
Metadata = tuple[tuple[str, str], ...]


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
        self._stream: MultiplexCall | None = None
        self._streams: set[MultiplexCall] = set()  # the current one, and closing ones
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
        inbox = stream.inboxes[number] = Inbox()
        start = inference_pb2.StartGeneration(
            request=inference_request(call),
            window=self._window,
            trace_context=dict(tracing.outgoing()),
        )
        stream.send(inference_pb2.GenerationControl(generation_id=number, start=start))
        first_tokens.start_sent()  # its writer's turn comes before what this held back
        reader, unread, finished = ChunkReader(), 0, False
        try:
            while not finished:
                replies, end = until_end(await inbox.take())
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

    def _open(self) -> MultiplexCall:
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None
        if self._stream is None or self._stream.closing:
            call = self._stub.Multiplex(metadata=self._metadata)
            message = inference_pb2.MultiplexRequest
            stream = MultiplexCall(call, message, UPSTREAM, self._address)
            self._streams.add(stream)
            stream.done.add_done_callback(lambda _: self._streams.discard(stream))
            self._stream = stream
        return self._stream

    def _idle_when_empty(self, stream: MultiplexCall) -> None:
        if stream is self._stream and not stream.inboxes and not stream.closing:
            loop = asyncio.get_running_loop()
            self._idle = loop.call_later(self._idle_close_s, self._close_if_idle, stream)

    def _close_if_idle(self, stream: MultiplexCall) -> None:
        if stream is self._stream and not stream.inboxes:
            stream.close()
            self._stream = None

"""Many generations over one Generation.GenerateStream call to a router: what a client
with many requests in flight (a gateway, a batch job, a load generator) uses instead of a
Generate call per request, as Triton's clients keep one ModelStreamInfer stream open.

The stream opens on first use and again after it ends. A generation's responses are
those a Generate call would stream; one that ends in an error raises the
``grpc.aio.AioRpcError`` the call would have ended with (its code, its message, and the
rich status in ``grpc-status-details-bin``, which ``grpc_status.rpc_status.from_call``
reads). Leaving a generation early cancels it in the router.
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncGenerator, Mapping

import grpc
from google.rpc import status_pb2

from llmmesh.multiplex_client import Frame, Inbox, MultiplexCall, until_end
from llmmesh.runtime.errors import MeshError
from llmmesh.v1 import generation_pb2, generation_pb2_grpc

Metadata = tuple[tuple[str, str], ...]
UPSTREAM = "router"
STATUS_DETAILS_KEY = "grpc-status-details-bin"


class GenerationStream:
    """``metadata``: the stream's (``authorization``); ``window``: responses a generation
    may have unread before the router waits for it (0: no limit)."""

    def __init__(self, channel: grpc.aio.Channel, metadata: Metadata = (), window: int = 0):
        self._stub = generation_pb2_grpc.GenerationStub(channel)
        self._metadata = metadata
        self._window = window
        self._call: MultiplexCall | None = None
        self._ids = itertools.count(1)

    async def generate(
        self,
        request: generation_pb2.GenerateRequest,
        *,
        request_id: str = "",
        color: str = "",
        timeout_s: float | None = None,
        trace_context: Mapping[str, str] | None = None,
    ) -> AsyncGenerator[generation_pb2.GenerateResponse, None]:
        """The generation's responses, as Generate streams them."""
        call = self._open()
        number = next(self._ids)
        inbox = call.inboxes[number] = Inbox()
        start = generation_pb2.GenerateStart(
            request=request,
            window=self._window,
            request_id=request_id,
            color=color,
            timeout_ms=0 if timeout_s is None else max(round(timeout_s * 1000), 1),
            trace_context=dict(trace_context or {}),
        )
        call.send(generation_pb2.GenerateControl(generation_id=number, start=start))
        finished, unread = False, 0
        try:
            while not finished:
                replies, end = until_end(await inbox.take())
                for reply in replies:
                    finished = finished or reply.finish_reason != 0
                    yield reply
                unread += len(replies)
                if self._window and unread >= self._window // 2 and not finished:
                    call.send(generation_pb2.GenerateControl(generation_id=number, credit=unread))
                    unread = 0
                if end is not None:
                    finished = True
                    raise _as_rpc_error(end)
        finally:
            del call.inboxes[number]
            if not finished and not call.closing:  # left early: the router must stop it
                call.send(generation_pb2.GenerateControl(generation_id=number, cancel=True))

    async def close(self) -> None:
        if self._call is not None:
            await self._call.abort()
            self._call = None

    def _open(self) -> MultiplexCall:
        if self._call is None or self._call.closing:
            call = self._stub.GenerateStream(metadata=self._metadata)
            message = generation_pb2.GenerateStreamRequest
            self._call = MultiplexCall(
                call, message, UPSTREAM, UPSTREAM, keep_call_errors=True, headers_first=True
            )
        return self._call


def _as_rpc_error(end: Frame) -> grpc.aio.AioRpcError:
    """The error a Generate call would have ended with."""
    if isinstance(end, grpc.aio.AioRpcError):  # the stream itself ended so
        return end
    if isinstance(end, MeshError):  # ... or ended without a status
        status = status_pb2.Status(code=grpc.StatusCode[end.code].value[0], message=end.message)
    else:
        status = status_pb2.Status.FromString(end.error)
    code = next((c for c in grpc.StatusCode if c.value[0] == status.code), grpc.StatusCode.UNKNOWN)
    trailers = grpc.aio.Metadata((STATUS_DETAILS_KEY, status.SerializeToString()))
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailers, details=status.message)

"""The calling side of a multiplexed stream (Inference.Multiplex, Generation.GenerateStream):
one open call, its one writer and one reader, and an inbox per generation on it.

Controls that come together go in one message; the reader hands each frame to its
generation's inbox. If the call breaks, every generation on it gets the error, as a
broken call per generation would have ended.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

import grpc
from prometheus_client import Counter

from llmmesh import first_tokens
from llmmesh.runtime.errors import Unavailable
from llmmesh.runtime.grpc_status import from_rpc_error

log = logging.getLogger(__name__)

# Frames of generations past their first handed over per loop turn: an engine step's
# responses for many generations come in one message, and each wakes a relay; in slices,
# what arrives meanwhile (a new request, another message's first token) waits for a
# slice, not the whole message. While first tokens' work is pending, no slice goes
# (llmmesh/first_tokens.py), for at most first_tokens.LATER_TOKENS_WAIT_S.
RELAY_SLICE = 32
HOLDS = Counter(
    "llm_relay_holds_total",
    "Times a relay held later tokens back for first tokens' work, by what ended the hold: "
    "the work (done), or the bound on a later token's wait (bound)",
    ["ended"],
)
_HOLD_DONE, _HOLD_BOUND = HOLDS.labels("done"), HOLDS.labels("bound")
# With headers_first, how long the writer waits for a server's headers at most.
HEADERS_WAIT_S = 1.0
# A message of controls stays well under gRPC's 4 MB default limit (one start is at most
# a prompt the router accepted, far less than this).
MAX_MESSAGE_BYTES = 1024 * 1024
# A generation's frame (GenerationFrame, GenerateFrame), or the error that broke the call:
# a MeshError, or the call's own AioRpcError where the caller keeps it.
Frame = Any


class Inbox:
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


def until_end(frames: list[Frame]) -> tuple[list[Any], Frame | None]:
    """The responses among ``frames``, and the frame that ends the generation, if any."""
    replies: list[Any] = []
    for frame in frames:
        if isinstance(frame, BaseException) or frame.HasField("error"):
            return replies, frame
        replies.append(frame.response)
    return replies, None


class MultiplexCall:
    """One open call: its writer, its reader, and the generations on it. ``message``
    builds the stream's request message from controls; ``upstream`` and ``where`` name
    the other end in errors (``where``, its address, in the log only). A broken call
    fails its generations with a MeshError, or with the call's own error if
    ``keep_call_errors`` (a client of the mesh, which wants the status as sent). With
    ``headers_first`` nothing is written before the other end's headers have come (a
    server that sends them once it has accepted the stream)."""

    def __init__(
        self,
        call: Any,
        message: Callable[..., Any],
        upstream: str,
        where: str,
        *,
        keep_call_errors: bool = False,
        headers_first: bool = False,
    ):
        self._call = call
        self._message = message
        self._upstream = upstream
        self._where = where
        self._keep_call_errors = keep_call_errors
        self._headers_first = headers_first
        self._controls: list[Any] = []
        self._wake = asyncio.Event()
        self.inboxes: dict[int, Inbox] = {}
        # Frames of started generations, in order, with the loop time they came at,
        # waiting for their slice of a loop turn.
        self._later: deque[tuple[Inbox, Frame, float]] = deque()
        self._all_handed = asyncio.Event()
        self._all_handed.set()
        self._first_tokens = first_tokens.work()
        self._holding: asyncio.TimerHandle | None = None  # the hold's end, while held
        self._asked_when_none = False
        self.closing = False  # no new generation here: it is being closed, or it broke
        self.unsupported = False
        self._writer = asyncio.ensure_future(self._write())
        self._reader = asyncio.ensure_future(self._read())
        self.done: asyncio.Future[None] = self._reader

    def send(self, control: Any) -> None:
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
            if self._headers_first:
                # The other end's headers say it took the stream. A write that crosses a
                # refusal fails in gRPC's core, which then reports the call as INTERNAL
                # in place of the refusal's own status; one made after it is not sent.
                # A server that sends no headers before its first response (a router
                # older than this client) gets the first message after a while.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._call.initial_metadata(), HEADERS_WAIT_S)
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
                "multiplexed stream cannot write", extra={"fields": {"upstream": self._where}}
            )
            self._call.cancel()

    def _next_message(self) -> Any:
        """The controls waiting, as many as fit one message: starts carry whole prompts,
        and a message past the replica's limit would fail every generation on the stream."""
        size, count = 0, 0
        for control in self._controls:
            size += control.ByteSize()
            if count and size > MAX_MESSAGE_BYTES:
                break
            count += 1
        controls, self._controls = self._controls[:count], self._controls[count:]
        return self._message(controls=controls)

    async def _read(self) -> None:
        ended: Exception = Unavailable(f"{self._upstream} ended the stream")
        try:
            async for message in self._call:
                self._hand_over(message.frames)
        except grpc.aio.AioRpcError as err:
            self.unsupported = err.code() == grpc.StatusCode.UNIMPLEMENTED
            kept = self._keep_call_errors
            ended = err if kept else from_rpc_error(err, self._upstream, self._where)
        finally:
            self.closing = True
            self._wake.set()  # the writer ends too
            # After the frames still to be handed over: each generation's end comes last.
            now = asyncio.get_running_loop().time()
            self._later.extend((inbox, ended, now) for inbox in self.inboxes.values())
            await self._handed_over()

    def _hand_over(self, frames: Iterable[Any]) -> None:
        """Each frame to its generation's inbox (frames that crossed a cancellation, to
        none): a generation's first frame at once, since a first token is what a client
        waits for most, and its generation's next step counts as first tokens' work; the
        rest queued, handed over a slice per loop turn. The reader goes on reading
        meanwhile, so a first token in the next message does not wait for this one's. A
        generation's own frames keep their order."""
        later = self._later
        queued = bool(later)
        loop = asyncio.get_running_loop()
        now = loop.time()
        firsts = False
        for frame in frames:
            inbox = self.inboxes.get(frame.generation_id)
            if inbox is None:
                continue
            if inbox.started:
                later.append((inbox, frame, now))
            else:
                inbox.put(frame)
                firsts = True
        if firsts:
            # Pending until the loop turn in which the generations take their frames
            # (their wakeups were scheduled before this).
            loop.call_soon(self._first_tokens.begin())
        if later and not queued:
            self._all_handed.clear()
            self._hand_over_slice()

    def _hand_over_slice(self) -> None:
        later = self._later
        if not later:  # handed over meanwhile (the call ended)
            self._all_handed.set()
            return
        loop = asyncio.get_running_loop()
        if self._first_tokens.pending:
            wait = later[0][2] + first_tokens.LATER_TOKENS_WAIT_S - loop.time()
            if wait > 0:
                self._hold(loop, wait)
                return
        for _ in range(min(RELAY_SLICE, len(later))):
            inbox, frame, _ = later.popleft()
            inbox.put(frame)
        if later:  # the rest after one loop turn: what arrived meanwhile runs first
            loop.call_soon(self._hand_over_slice)
        else:
            self._all_handed.set()

    def _hold(self, loop: asyncio.AbstractEventLoop, seconds: float) -> None:
        """No slice until first tokens' work is done, or the oldest frame held has waited
        its longest."""
        self._holding = loop.call_later(seconds, self._end_hold, _HOLD_BOUND)
        if not self._asked_when_none:
            self._asked_when_none = True
            self._first_tokens.when_none(self._none_pending)

    def _none_pending(self) -> None:
        self._asked_when_none = False
        self._end_hold(_HOLD_DONE)

    def _end_hold(self, ended: Counter) -> None:
        if self._holding is None:
            return
        ended.inc()
        self._holding.cancel()
        self._holding = None
        self._hand_over_slice()

    async def _handed_over(self) -> None:
        """Waits until every queued frame is in its inbox; cut short, hands them all over."""
        try:
            await self._all_handed.wait()
        finally:
            if self._holding is not None:
                self._holding.cancel()
                self._holding = None
            while self._later:
                inbox, frame, _ = self._later.popleft()
                inbox.put(frame)

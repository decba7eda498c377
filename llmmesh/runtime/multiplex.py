"""Many generations over one caller's stream, served: Inference.Multiplex (a router's
stream to a replica) and Generation.GenerateStream (a client's to the router).

A request costs two small messages on a stream that exists (its start, then its
responses) rather than a call of its own: no headers, no new HTTP/2 stream, no handler
set up and torn down per generation. Each generation runs as the service's
unary-request call would run it (the same responses from the same core), in a task of
its own; responses that are ready together (one engine step produces a token for every
running sequence) go out as one message. Each generation has its own window of
responses the caller has not taken yet, so a slow reader holds back only its own.

Every message costs both ends a wakeup across gRPC's threads, which on a small machine
costs far more than the bytes. So a generation's later responses may wait ``hold_s`` for
others to go with them (the responses of one engine step reach this service one stream
at a time, a little apart) and for its own next ones; its first ``first_unheld``
responses (a client's first words: a streamed output check shows a word only once the
next one starts), its last and an error never wait, nor hold back what waits with them.
Nor does anything wait while responses come further apart than ``hold_s`` (one stream on
an engine slower per token than the hold): no company would come, and the wait would
cost a timer's wakeup per response.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from google.protobuf.unknown_fields import UnknownFieldSet
from opentelemetry import trace

from llmmesh import first_tokens
from llmmesh.runtime import tracing
from llmmesh.runtime.errors import (
    DeadlineExceeded,
    InvalidArgument,
    MeshError,
    ResourceExhausted,
    Unavailable,
)
from llmmesh.runtime.grpc_status import to_status
from llmmesh.runtime.logs import request_id_var
from llmmesh.runtime.metadata import MAX_REQUEST_ID_LEN
from llmmesh.runtime.registration import MalformedRequest, generation_ids, unknown_field
from llmmesh.v1 import generation_pb2, inference_pb2

log = logging.getLogger(__name__)

# A generation's responses, for its start control and its request id (bound for log lines).
Responses = Callable[[Any, str], AsyncIterator[Any]]

# A message carries at most this many frames (each a token or a few), well under gRPC's
# message limit even with log probabilities in every frame.
MAX_FRAMES_PER_MESSAGE = 256
# Frames waiting for a caller that does not read: past this, generations wait to post more
# and no new control is read (as a Generate call's writes wait for its reader), so a slow
# or hostile caller holds no more of the service's memory than this.
MAX_WAITING_FRAMES = 4 * MAX_FRAMES_PER_MESSAGE
# Weight of the newest gap between frames in their moving average (about the last five).
GAP_WEIGHT = 0.2
DRAINING = "shutting down"
UNKNOWN_ACTION = "one of start, cancel or credit"


@dataclass(frozen=True)
class Wire:
    """The service's own messages. Both services' controls have the same shape
    (``generation_id``, the ``action`` oneof of ``start``, ``cancel`` and ``credit``; a
    start's ``window`` and ``trace_context``), and so do their frames (``generation_id``
    with ``response`` or ``error``) and messages (``frames``)."""

    frame: Callable[..., Any]
    message: Callable[..., Any]
    span_name: str  # the generation's server span, named as the unary call's
    given_request_id: Callable[[Any], str]  # the id a start names ("" for none)
    # The seconds a start gives its generation, as a call's deadline would (None: no limit).
    timeout_s: Callable[[Any], float | None] = lambda start: None
    # Generations that may run at once on one stream (None: no limit, for the mesh's own).
    max_running: int | None = None


# The two services that multiplex. The public stream names its request id beside the
# request, as Generate's metadata would, and may give a generation a deadline.
INFERENCE_MULTIPLEX = Wire(
    frame=inference_pb2.GenerationFrame,
    message=inference_pb2.MultiplexResponse,
    span_name="/llmmesh.v1.Inference/Generate",
    given_request_id=lambda start: start.request.request_id,
)
GENERATE_STREAM = Wire(
    frame=generation_pb2.GenerateFrame,
    message=generation_pb2.GenerateStreamResponse,
    span_name="/llmmesh.v1.Generation/Generate",
    given_request_id=lambda start: start.request_id,
    timeout_s=lambda start: start.timeout_ms / 1000 or None,
    max_running=1024,
)


@dataclass
class _Generation:
    """One running generation: its task and what the caller's window still allows."""

    window: int  # responses it may send now; unlimited when the caller set no window
    limited: bool
    task: asyncio.Task[None] | None = None
    credit: asyncio.Event = field(default_factory=asyncio.Event)

    def add(self, credit: int) -> None:
        self.window += credit
        if self.window > 0:
            self.credit.set()

    async def take(self) -> None:
        """Waits until the window allows one more response, and counts it."""
        if not self.limited:
            return
        while self.window <= 0:
            self.credit.clear()
            await self.credit.wait()
        self.window -= 1


class Arrivals:
    """How far apart frames come, lately: a moving average of the gaps between them
    (none yet: 0, as if company were near)."""

    def __init__(self) -> None:
        self.gap_s = 0.0
        self._last = 0.0

    def note(self, now: float) -> None:
        if self._last:
            self.gap_s += GAP_WEIGHT * (now - self._last - self.gap_s)
        self._last = now


class MultiplexSession:
    """One caller's stream: its running generations and the frames waiting to go out."""

    def __init__(
        self, wire: Wire, responses: Responses, hold_s: float = 0.0, first_unheld: int = 1
    ) -> None:
        self._wire = wire
        self._responses = responses
        self._hold_s = hold_s
        self._first_unheld = first_unheld
        self._running: dict[int, _Generation] = {}
        self._outbox: list[Any] = []
        self._room = asyncio.Event()  # set while the outbox is under MAX_WAITING_FRAMES
        self._room.set()
        self._held_since = 0.0  # loop time the oldest frame waiting was posted
        self._arrivals = Arrivals()
        self._urgent_at = 0  # frames up to the last urgent one waiting must go now
        self._wake = asyncio.Event()
        self._input_done = False
        self._draining = False
        self._refused: MeshError | None = None  # a message that ends the stream

    async def serve(self, requests: AsyncIterator[Any]) -> AsyncGenerator[Any, None]:
        """The stream's responses until the caller closes its side and every generation
        has ended (or the replica drains); a stream cut short cancels them all."""
        reader = asyncio.ensure_future(self._read(requests))
        try:
            async for message in self._messages():
                yield message
        finally:
            reader.cancel()
            tasks = [g.task for g in self._running.values() if g.task is not None]
            for task in tasks:
                task.cancel()
            await asyncio.gather(reader, *tasks, return_exceptions=True)

    def drain(self) -> None:
        """No new generation from now on; the stream ends with its last running one."""
        self._draining = True
        self._wake.set()

    async def _messages(self) -> AsyncIterator[Any]:
        loop = asyncio.get_running_loop()
        while True:
            if self._refused is not None:
                raise self._refused
            if not self._outbox:
                if (self._input_done or self._draining) and not self._running:
                    return
                await self._wake.wait()
                self._wake.clear()
                continue
            await self._hold(loop)
            frames = self._outbox[:MAX_FRAMES_PER_MESSAGE]
            del self._outbox[:MAX_FRAMES_PER_MESSAGE]
            if len(self._outbox) < MAX_WAITING_FRAMES:
                self._room.set()
            self._urgent_at = max(self._urgent_at - len(frames), 0)
            self._held_since = loop.time()  # what came meanwhile waited for the write
            yield self._wire.message(frames=frames)

    async def _hold(self, loop: asyncio.AbstractEventLoop) -> None:
        """Later responses wait for company, up to hold_s; an urgent one ends the wait."""
        while self._outbox and not self._urgent_at:
            remaining = self._held_since + self._hold_s - loop.time()
            if remaining <= 0:
                return
            timer = loop.call_later(remaining, self._wake.set)
            await self._wake.wait()
            self._wake.clear()
            timer.cancel()

    async def _read(self, requests: AsyncIterator[Any]) -> None:
        try:
            async for request in requests:
                await self._room.wait()
                if isinstance(request, MalformedRequest):
                    self._refuse(request)
                    continue
                for control in request.controls:
                    self._apply(control)
        finally:
            self._input_done = True
            self._wake.set()

    def _refuse(self, malformed: MalformedRequest) -> None:
        """A message that does not parse (a start with a string that is not UTF-8), or
        that has a field this schema does not have, is refused for each generation it
        names, with the error naming the field, as a start that cannot be taken is (a
        running one ends with it); the stream and its other generations go on. One whose
        generations cannot be told ends the stream."""
        controls = _controls_apart(malformed)
        if controls is not None:  # those with a field this schema lacks are refused alone
            for index, control in enumerate(controls):
                refusal = unknown_field(control, f"controls[{index}]")
                if refusal is None:
                    self._apply(control)
                else:
                    self._end_with(control.generation_id, refusal)
            return
        numbers = generation_ids(malformed.data)
        if not numbers:
            self._refused = malformed.error
            self._wake.set()
            return
        for number in numbers:
            self._end_with(number, malformed.error)

    def _apply(self, control: Any) -> None:
        number = control.generation_id
        action = control.WhichOneof("action")
        running = self._running.get(number)
        if action == "start":
            if running is not None or number == 0:
                why = "generation_id: 0, or one that is running on this stream"
                self._post_error(number, Unavailable(why))
            elif self._draining:
                self._post_error(number, Unavailable(DRAINING))
            elif self._full():
                why = f"at most {self._wire.max_running} generations at once on one stream"
                self._post_error(number, ResourceExhausted(why, retry_after_s=1.0))
            else:
                self._start(number, control.start)
        elif running is not None and action == "cancel":
            if running.task is not None:
                running.task.cancel()
        elif running is not None and action == "credit":
            running.add(control.credit)
        elif action is None:  # none at all: refused, never ignored
            self._end_with(number, InvalidArgument("controls.action", UNKNOWN_ACTION))
        # A control for a generation that has ended already is moot: it crossed its end.

    def _full(self) -> bool:
        limit = self._wire.max_running
        return limit is not None and len(self._running) >= limit

    def _start(self, number: int, start: Any) -> None:
        generation = _Generation(window=start.window, limited=start.window > 0)
        self._running[number] = generation
        generation.task = first_tokens.pending_task(self._run(number, start, generation))

    async def _run(self, number: int, start: Any, generation: _Generation) -> None:
        wire = self._wire
        request_id = wire.given_request_id(start)[:MAX_REQUEST_ID_LEN] or uuid.uuid4().hex
        request_id_var.set(request_id)
        parent = tracing.incoming(dict(start.trace_context))
        span = (
            tracing.tracer.start_span(wire.span_name, context=parent, kind=trace.SpanKind.SERVER)
            if tracing.wanted(parent)
            else None
        )
        timeout_s = wire.timeout_s(start)
        deadline = asyncio.timeout(timeout_s) if timeout_s is not None else None
        try:
            with tracing.using(span, end_on_exit=True) if span else contextlib.nullcontext():
                async with deadline or contextlib.nullcontext():
                    await self._relay(number, start, request_id, generation)
        except asyncio.CancelledError:
            pass  # the caller cancelled it (or left): nothing more goes out for it
        except TimeoutError:
            if deadline is None or not deadline.expired():  # not its own limit: a failure
                log.exception("generation failed", extra={"fields": {"generation": number}})
                self._post_error(number, Unavailable("the generation failed: TimeoutError"))
            else:
                self._post_error(number, DeadlineExceeded("the generation's deadline passed"))
        except MeshError as err:
            self._post_error(number, err)
        except Exception as err:  # a bug here must not take the other generations down
            log.exception("generation failed", extra={"fields": {"generation": number}})
            self._post_error(number, Unavailable(f"inference failed: {type(err).__name__}"))
        finally:
            del self._running[number]
            self._wake.set()

    async def _relay(
        self, number: int, start: Any, request_id: str, generation: _Generation
    ) -> None:
        sent = 0
        async for response in self._responses(start, request_id):
            await generation.take()
            await self._room.wait()
            frame = self._wire.frame(generation_id=number, response=response)
            early = sent < self._first_unheld
            last = bool(response.finish_reason)
            self._post(frame, urgent=early or last)
            if not sent or last:
                # The writer, woken by the post, goes before what this generation does
                # next (its bookkeeping after a first response, its teardown after the
                # last): a loop turn later for that, the response out sooner.
                await asyncio.sleep(0)
            sent += 1

    def _post(self, frame: Any, urgent: bool) -> None:
        now = asyncio.get_running_loop().time()
        self._arrivals.note(now)
        if not self._outbox:
            self._held_since = now
        self._outbox.append(frame)
        if len(self._outbox) >= MAX_WAITING_FRAMES:
            self._room.clear()
        if urgent or self._arrivals.gap_s >= self._hold_s:  # no hold, or no company in sight
            self._urgent_at = len(self._outbox)
        self._wake.set()

    def _end_with(self, number: int, err: MeshError) -> None:
        """Refuses a control: its generation, running or not, ends with ``err`` (an
        error frame is a generation's last; nothing more goes out for it)."""
        running = self._running.get(number)
        if running is not None and running.task is not None:
            running.task.cancel()
        self._post_error(number, err)

    def _post_error(self, number: int, err: MeshError) -> None:
        status = to_status(err).SerializeToString()
        self._post(self._wire.frame(generation_id=number, error=status), True)


class OpenSessions:
    """A service's multiplexed streams while they are open, so that shutdown drains them
    all: no new generation on any, each ending with its last running one."""

    def __init__(self) -> None:
        self._open: set[MultiplexSession] = set()
        self.draining = False

    async def serve(
        self, session: MultiplexSession, requests: AsyncIterator[Any]
    ) -> AsyncIterator[Any]:
        self._open.add(session)
        if self.draining:
            session.drain()
        try:
            async for message in session.serve(requests):
                yield message
        finally:
            self._open.discard(session)

    def drain(self) -> None:
        self.draining = True
        for session in self._open:
            session.drain()


def _controls_apart(malformed: MalformedRequest) -> Any:
    """The controls of a message that parsed but has fields this schema does not have,
    where those are all inside its controls (each control then stands on its own); None
    otherwise."""
    parsed = malformed.parsed
    if parsed is None or len(UnknownFieldSet(parsed)):
        return None
    return parsed.controls

"""Generations over one Multiplex stream per replica: the router's GenerationMux against
the inference service's real servicer on a real grpc.aio server (loopback, ephemeral
port), over a scripted engine in this process."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest

from llmmesh import first_tokens, multiplex_client
from llmmesh.runtime.errors import InvalidArgument, Unavailable
from llmmesh.runtime.registration import add_servicer
from llmmesh.types import Chunk, FinishReason, InferenceCall, ModelCard, Sampling
from llmmesh.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from services.inference.core import InferenceCore
from services.inference.load import LoadMonitor
from services.inference.server import SERVICE, InferenceServicer
from services.router.multiplex import GenerationMux
from services.router.upstreams import ChunkReader, ReplicaClient

ALPHABET = "abcdefghijklmnopqrstuvwxyz"


class Progress:
    """Lets a test wait for another task's progress: every change bumps it."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def bump(self) -> None:
        self._event.set()
        self._event = asyncio.Event()

    async def until(self, condition: Callable[[], bool]) -> None:
        while not condition():
            await self._event.wait()


@dataclass
class ScriptedEngine:
    """Generates ``max_tokens`` letters, one per chunk; a prompt starting with "wait"
    pauses after each chunk until ``go`` is set, one starting with "step" until ``steps``
    is released once more. Counts what it produced and which generations ended early."""

    produced: dict[str, int] = field(default_factory=dict)
    cancelled: set[str] = field(default_factory=set)
    go: asyncio.Event = field(default_factory=asyncio.Event)
    steps: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(0))
    progress: Progress = field(default_factory=Progress)

    async def generate(self, call: InferenceCall) -> AsyncIterator[Chunk]:
        self.produced[call.prompt] = 0
        finished = False
        try:
            total = call.sampling.max_tokens
            for i in range(total):
                if call.prompt.startswith("wait") and i:
                    await self.go.wait()
                if call.prompt.startswith("step") and i:
                    await self.steps.acquire()
                self.produced[call.prompt] += 1
                self.progress.bump()
                last = FinishReason.LENGTH if i == total - 1 else None
                finished = last is not None
                yield Chunk(ALPHABET[(len(call.prompt) + i) % 26], 1, last)
        finally:
            if not finished:
                self.cancelled.add(call.prompt)
            self.progress.bump()

    async def describe(self, model: str) -> ModelCard:
        return ModelCard(model, 2048)


async def _no_engine_page() -> str:
    return ""


class CountingServicer(InferenceServicer):
    def __init__(
        self, core: InferenceCore, progress: Progress, hold_s: float = 0.0, first_unheld: int = 1
    ) -> None:
        monitor = LoadMonitor(_no_engine_page, lambda: 0, core.latency)
        super().__init__(core, monitor, "test", hold_s, first_unheld)
        self._progress = progress
        self.streams = 0  # Multiplex calls opened
        self.open_streams = 0

    async def Multiplex(  # noqa: N802 (gRPC method name)
        self, requests: AsyncIterator[inference_pb2.MultiplexRequest], context: Any
    ) -> AsyncIterator[inference_pb2.MultiplexResponse]:
        self.streams += 1
        self.open_streams += 1
        try:
            async for message in super().Multiplex(requests, context):
                yield message
        finally:
            self.open_streams -= 1
            self._progress.bump()


@dataclass(frozen=True)
class Replica:
    """A replica's servicer and engine, and the router's ways to call it."""

    mux: GenerationMux
    per_call: ReplicaClient
    servicer: CountingServicer
    engine: ScriptedEngine
    stub: inference_pb2_grpc.InferenceStub  # the replica's other calls


Scenario = Callable[[Replica], Awaitable[None]]


def run(
    scenario: Scenario,
    *,
    window: int = 64,
    idle_close_s: float = 30.0,
    hold_s: float = 0.0,
    first_unheld: int = 1,
) -> None:
    async def main() -> None:
        engine = ScriptedEngine()
        core = InferenceCore(engine, max_tokens_limit=512)
        servicer = CountingServicer(core, engine.progress, hold_s, first_unheld)
        server = grpc.aio.server()
        add_servicer(server, servicer, SERVICE)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        mux = GenerationMux(channel, "test", window=window, idle_close_s=idle_close_s)
        stub = inference_pb2_grpc.InferenceStub(channel)
        replica = Replica(mux, ReplicaClient(channel, "test"), servicer, engine, stub)
        try:
            await asyncio.wait_for(scenario(replica), 30)
        finally:
            await mux.close()
            await channel.close()
            await server.stop(0)

    asyncio.run(main())


def call(prompt: str, max_tokens: int = 8, request_id: str = "r") -> InferenceCall:
    return InferenceCall(request_id, "llm", prompt, Sampling(max_tokens=max_tokens))


async def collect(chunks: AsyncIterator[Chunk]) -> list[Chunk]:
    return [chunk async for chunk in chunks]


async def tokens(chunks: AsyncIterator[Chunk]) -> int:
    """The tokens of a whole generation (responses that arrive together come as one chunk)."""
    return sum(chunk.num_tokens for chunk in await collect(chunks))


def whole(chunks: list[Chunk]) -> tuple[str, int, FinishReason | None]:
    return (
        "".join(c.text for c in chunks),
        sum(c.num_tokens for c in chunks),
        chunks[-1].finish_reason,
    )


def test_concurrent_generations_share_one_stream_and_match_generate() -> None:
    async def scenario(replica: Replica) -> None:
        prompts = [f"prompt {'x' * i}" for i in range(12)]
        muxed = await asyncio.gather(*(collect(replica.mux.generate(call(p))) for p in prompts))
        for prompt, chunks in zip(prompts, muxed, strict=True):
            per_call = await collect(replica.per_call.generate(call(prompt)))
            assert whole(chunks) == whole(per_call)
            assert whole(chunks)[1:] == (8, FinishReason.LENGTH)
            assert all(c.text for c in chunks)
        assert replica.servicer.streams == 1

    run(scenario)


def test_later_responses_wait_for_company_and_the_first_and_last_never_wait() -> None:
    async def scenario(replica: Replica) -> None:
        chunks = await collect(replica.mux.generate(call("quick", max_tokens=8)))
        # The first alone at once; the rest waited for the last, which ended the wait.
        assert [c.num_tokens for c in chunks] == [1, 7]
        assert chunks[-1].finish_reason is FinishReason.LENGTH

    run(scenario, hold_s=10.0)  # far longer than the test: only the last ends the wait


def test_a_generations_first_responses_never_wait() -> None:
    async def scenario(replica: Replica) -> None:
        chunks = replica.mux.generate(call("step by step", max_tokens=8))
        for _ in range(3):  # each reaches the router before the engine makes the next
            first = await asyncio.wait_for(anext(chunks), 5)  # held: 10 s
            assert first.num_tokens == 1
            replica.engine.steps.release()
        for _ in range(4):
            replica.engine.steps.release()
        rest = await collect(chunks)  # the later four waited for the last
        assert [c.num_tokens for c in rest] == [5]

    run(scenario, hold_s=10.0, first_unheld=3)


def test_starts_that_come_together_never_make_a_message_past_the_limit() -> None:
    async def scenario(replica: Replica) -> None:
        # 16 starts of 400 KB each, together 6.4 MB: one message would pass the replica's
        # 4 MB limit and fail every generation on the stream.
        prompts = [f"{i} " + "y" * 400_000 for i in range(16)]
        done = await asyncio.gather(*(tokens(replica.mux.generate(call(p))) for p in prompts))
        assert done == [8] * 16
        assert replica.servicer.streams == 1

    run(scenario)


def test_a_generation_cut_short_is_cancelled_in_the_engine_and_no_other() -> None:
    async def scenario(replica: Replica) -> None:
        mux, engine = replica.mux, replica.engine
        stopped = mux.generate(call("wait, then stop", max_tokens=50))
        assert (await anext(stopped)).text
        other = asyncio.ensure_future(collect(mux.generate(call("runs to its end"))))
        await stopped.aclose()
        await engine.progress.until(lambda: "wait, then stop" in engine.cancelled)
        assert whole(await other)[1] == 8
        assert engine.cancelled == {"wait, then stop"}
        assert engine.produced["wait, then stop"] <= 2

    run(scenario)


def test_a_refusal_names_the_field_and_leaves_the_stream_serving() -> None:
    async def scenario(replica: Replica) -> None:
        mux, servicer = replica.mux, replica.servicer
        bad = InferenceCall("r", "llm", "hi", Sampling(max_tokens=8), priority=-1)
        with pytest.raises(InvalidArgument) as refused:
            await collect(mux.generate(bad))
        assert refused.value.field == "priority"
        assert await tokens(mux.generate(call("after it"))) == 8
        assert servicer.streams == 1

    run(scenario)


def test_a_slow_reader_holds_back_only_its_own_generation() -> None:
    async def scenario(replica: Replica) -> None:
        mux, engine = replica.mux, replica.engine
        engine.go.set()
        unread = mux.generate(call("slow reader", max_tokens=200))
        await anext(unread)  # then reads nothing more for a while
        # The window's 4 responses sent, the 5th made and waiting for credit.
        await engine.progress.until(lambda: engine.produced["slow reader"] == 5)
        done = await collect(mux.generate(call("reads all", max_tokens=200)))
        assert whole(done)[1] == 200
        assert engine.produced["slow reader"] == 5  # held back all the while
        rest = await collect(unread)
        assert whole(rest)[1] == 199

    run(scenario, window=4)


def test_a_draining_replica_ends_its_stream_after_its_last_generation() -> None:
    async def scenario(replica: Replica) -> None:
        mux, servicer, engine = replica.mux, replica.servicer, replica.engine
        running = mux.generate(call("wait for the drain", max_tokens=4))
        assert (await anext(running)).text
        servicer.drain()
        with pytest.raises(Unavailable, match="shutting down"):
            await collect(mux.generate(call("too late")))
        engine.go.set()
        assert await tokens(running) == 3  # the running one ends whole
        await engine.progress.until(lambda: servicer.open_streams == 0)

    run(scenario)


def test_a_draining_replica_ends_its_load_reports_with_its_last_generation() -> None:
    """Left open, a router's report stream would hold the server's grace period to its
    end; ended while a generation runs, it would have the router end that generation as
    if the replica had fallen silent."""

    async def scenario(replica: Replica) -> None:
        mux, servicer, engine = replica.mux, replica.servicer, replica.engine
        watch = inference_pb2.WatchLoadRequest(max_interval_ms=60_000)  # a report a minute
        stream: Any = replica.stub.WatchLoad(watch)  # an aio stub, typed as the sync one
        reports = aiter(stream)
        assert (await anext(reports)).replica == "test"
        running = mux.generate(call("wait for the drain", max_tokens=4))
        assert (await anext(running)).text
        servicer.drain()
        ended = asyncio.ensure_future(anext(reports, None))
        with pytest.raises(Unavailable, match="shutting down"):
            await collect(mux.generate(call("too late")))  # the drain has taken effect
        assert not ended.done()  # the running generation keeps the reports going
        engine.go.set()
        assert await tokens(running) == 3
        assert await asyncio.wait_for(ended, 5) is None

    run(scenario)


def test_an_idle_stream_is_closed_and_a_new_one_opened_on_demand() -> None:
    async def scenario(replica: Replica) -> None:
        mux, servicer = replica.mux, replica.servicer
        assert await tokens(mux.generate(call("first"))) == 8
        await replica.engine.progress.until(lambda: servicer.open_streams == 0)
        assert await tokens(mux.generate(call("second"))) == 8
        assert servicer.streams == 2

    run(scenario, idle_close_s=0.05)


def test_a_replica_without_multiplex_is_called_per_generation() -> None:
    async def main() -> None:
        engine = ScriptedEngine()
        servicer = CountingServicer(InferenceCore(engine, max_tokens_limit=512), engine.progress)
        generate_only = grpc.unary_stream_rpc_method_handler(
            servicer.Generate,
            request_deserializer=inference_pb2.InferenceRequest.FromString,
            response_serializer=inference_pb2.InferenceResponse.SerializeToString,
        )
        server = grpc.aio.server()
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(SERVICE.full_name, {"Generate": generate_only}),)
        )
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        mux = GenerationMux(channel, "old")
        try:
            first = await collect(mux.generate(call("one")))
            second = await collect(mux.generate(call("two")))
            assert whole(first)[1] == whole(second)[1] == 8
            assert not mux.supported
        finally:
            await mux.close()
            await channel.close()
            await server.stop(0)

    asyncio.run(main())


def test_a_broken_stream_fails_its_generations_as_unavailable() -> None:
    async def main() -> None:
        engine = ScriptedEngine()
        servicer = CountingServicer(InferenceCore(engine, max_tokens_limit=512), engine.progress)
        server = grpc.aio.server()
        add_servicer(server, servicer, SERVICE)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        mux = GenerationMux(channel, "gone")
        try:
            stream = mux.generate(call("wait forever", max_tokens=8))
            assert (await anext(stream)).text
            await server.stop(0)  # the replica's process goes away
            with pytest.raises(Unavailable):
                await collect(stream)
        finally:
            await mux.close()
            await channel.close()

    asyncio.run(main())


def test_responses_that_arrived_together_are_one_chunk_with_all_they_carry() -> None:
    def reply(text: str, total: int, finish: Any = 0, cached: int = 0) -> Any:
        scored = [common_pb2.TokenLogprob(token=ord(text), text=text, logprob=-0.5, rank=1)]
        return inference_pb2.InferenceResponse(
            text=text, num_output_tokens=total, finish_reason=finish, logprobs=scored,
            cached_tokens=cached,
        )  # fmt: skip

    reader = ChunkReader()
    first = reader.merged([reply("a", 1, cached=7)])
    rest = reader.merged(
        [reply("b", 2), reply("c", 3), reply("d", 4, common_pb2.FINISH_REASON_LENGTH)]
    )
    assert (first.text, first.num_tokens, first.cached_tokens) == ("a", 1, 7)
    assert (rest.text, rest.num_tokens, rest.finish_reason) == ("bcd", 3, FinishReason.LENGTH)
    assert [lp.text for lp in rest.logprobs] == ["b", "c", "d"]
    assert rest.cached_tokens == 0


def test_a_message_that_cannot_be_written_fails_the_stream_rather_than_hang(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def unwritable(self: Any) -> None:
        raise ValueError("cannot be serialized")

    async def scenario(replica: Replica) -> None:
        with pytest.raises(Unavailable):
            await collect(replica.mux.generate(call("never sent")))

    monkeypatch.setattr(multiplex_client.MultiplexCall, "_next_message", unwritable)
    run(scenario)


class _ScriptedCall:
    """A Multiplex call whose replica sends ``messages``, then ends the stream."""

    def __init__(self, messages: list[inference_pb2.MultiplexResponse]) -> None:
        self._messages = messages

    async def _replies(self) -> AsyncIterator[inference_pb2.MultiplexResponse]:
        for message in self._messages:
            yield message

    def __aiter__(self) -> AsyncIterator[inference_pb2.MultiplexResponse]:
        return self._replies()

    async def write(self, message: inference_pb2.MultiplexRequest) -> None:
        return None

    async def done_writing(self) -> None:
        return None

    def cancel(self) -> bool:
        return True


class _RecordingInbox(multiplex_client.Inbox):
    """Notes each frame's text as it is handed over, in a list shared by a test's inboxes."""

    __slots__ = ("handed",)

    def __init__(self, handed: list[str], started: bool = False) -> None:
        super().__init__()
        self.handed = handed
        self.started = started

    def put(self, frame: multiplex_client.Frame) -> None:
        if not isinstance(frame, Unavailable):  # the stream's end, after the script
            assert not isinstance(frame, BaseException)
            self.handed.append(frame.response.text)
        super().put(frame)


def _frame(generation: int, text: str) -> inference_pb2.GenerationFrame:
    response = inference_pb2.InferenceResponse(text=text)
    return inference_pb2.GenerationFrame(generation_id=generation, response=response)


def _later_frames(count: int) -> inference_pb2.MultiplexResponse:
    """One message of a token for each of generations 1 to ``count``."""
    return inference_pb2.MultiplexResponse(
        frames=[_frame(n, f"token {n}") for n in range(1, count + 1)]
    )


def _read_through(
    messages: list[inference_pb2.MultiplexResponse],
    inboxes: dict[int, multiplex_client.Inbox],
) -> None:
    async def scenario() -> None:
        call = _ScriptedCall(messages)
        stream = multiplex_client.MultiplexCall(
            call, inference_pb2.MultiplexRequest, "inference replica", "replica"
        )
        stream.inboxes.update(inboxes)  # before the reader's first turn
        await stream.done

    asyncio.run(scenario())


def test_a_first_token_is_handed_over_before_other_generations_later_ones() -> None:
    handed: list[str] = []
    streaming = _RecordingInbox(handed, started=True)
    starting = _RecordingInbox(handed)
    message = inference_pb2.MultiplexResponse(
        frames=[_frame(1, "later"), _frame(2, "first"), _frame(1, "later still"),
                _frame(2, "second")]
    )  # fmt: skip
    _read_through([message], {1: streaming, 2: starting})
    # the first token ahead; each generation's own frames in their order
    assert handed == ["first", "later", "later still", "second"]


def test_a_long_message_is_handed_over_a_slice_per_loop_turn() -> None:
    handed: list[str] = []
    count = 2 * multiplex_client.RELAY_SLICE + 1
    inboxes: dict[int, multiplex_client.Inbox] = {
        n: _RecordingInbox(handed, started=True) for n in range(1, count + 1)
    }
    message = _later_frames(count)

    class _Meanwhile(_RecordingInbox):
        def put(self, frame: multiplex_client.Frame) -> None:
            if not isinstance(frame, Unavailable):  # its token, not the stream's end
                loop = asyncio.get_running_loop()
                loop.call_soon(handed.append, "work that came meanwhile")
            super().put(frame)

    inboxes[1] = _Meanwhile(handed, started=True)
    _read_through([message], inboxes)
    # what the first frame's hand-over scheduled ran after one slice, not after them all
    assert handed.index("work that came meanwhile") == multiplex_client.RELAY_SLICE
    assert handed.count("work that came meanwhile") == 1
    assert [text for text in handed if text.startswith("token")] == [
        f"token {n}" for n in range(1, count + 1)
    ]


def test_a_first_token_in_the_next_message_waits_for_no_more_than_a_slice() -> None:
    handed: list[str] = []
    count = 2 * multiplex_client.RELAY_SLICE + 1
    inboxes: dict[int, multiplex_client.Inbox] = {
        n: _RecordingInbox(handed, started=True) for n in range(1, count + 1)
    }
    inboxes[count + 1] = _RecordingInbox(handed)  # not started yet
    burst = _later_frames(count)
    then = inference_pb2.MultiplexResponse(frames=[_frame(count + 1, "first")])
    _read_through([burst, then], inboxes)
    # the reader read on while the burst went over a slice a turn
    assert handed.index("first") == multiplex_client.RELAY_SLICE
    assert [text for text in handed if text.startswith("token")] == [
        f"token {n}" for n in range(1, count + 1)
    ]


def test_each_generation_gets_the_end_of_a_stream_after_its_queued_frames() -> None:
    handed: list[str] = []
    count = 2 * multiplex_client.RELAY_SLICE + 1
    inboxes = {n: _RecordingInbox(handed, started=True) for n in range(1, count + 1)}
    burst = _later_frames(count)
    _read_through([burst], dict(inboxes))
    for number, inbox in inboxes.items():
        frames = asyncio.run(inbox.take())
        assert frames[0].response.text == f"token {number}"
        assert isinstance(frames[-1], Unavailable)  # the end, after its frame


def test_later_frames_wait_while_first_tokens_work_is_pending(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(first_tokens, "LATER_TOKENS_WAIT_S", 30.0)  # only the release
    handed: list[str] = []
    inboxes = {n: _RecordingInbox(handed, started=True) for n in (1, 2)}

    class _ReleasingCall(_ScriptedCall):
        """Sends its messages, then ends the work of a request on its way elsewhere."""

        def __init__(self, release: first_tokens.Release) -> None:
            super().__init__([_later_frames(2)])
            self._release = release

        async def _replies(self) -> AsyncIterator[inference_pb2.MultiplexResponse]:
            async for message in super()._replies():
                yield message
            handed.append("released")
            self._release()

    async def scenario() -> None:
        release = first_tokens.work().begin()
        stream = multiplex_client.MultiplexCall(
            _ReleasingCall(release), inference_pb2.MultiplexRequest, "r", "r"
        )
        stream.inboxes.update(inboxes)
        await asyncio.wait_for(stream.done, 5)  # fails, not hangs, if never handed over

    done_before = multiplex_client.HOLDS.labels("done")._value.get()
    asyncio.run(scenario())
    assert handed == ["released", "token 1", "token 2"]
    assert multiplex_client.HOLDS.labels("done")._value.get() == done_before + 1


def test_a_first_tokens_next_step_goes_before_the_later_frames_that_came_with_it() -> None:
    handed: list[str] = []

    class _Starting(_RecordingInbox):
        def put(self, frame: multiplex_client.Frame) -> None:
            if not isinstance(frame, Unavailable):  # its generation wakes, as a task would
                asyncio.get_running_loop().call_soon(handed.append, "its next step")
            super().put(frame)

    inboxes: dict[int, multiplex_client.Inbox] = {
        n: _RecordingInbox(handed, started=True) for n in range(1, 4)
    }
    inboxes[9] = _Starting(handed)
    message = _later_frames(3)
    message.frames.append(_frame(9, "first"))
    _read_through([message], inboxes)
    assert handed == ["first", "its next step", "token 1", "token 2", "token 3"]


def test_later_frames_wait_no_longer_than_the_bound_for_work_that_does_not_end(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(first_tokens, "LATER_TOKENS_WAIT_S", 0.05)
    handed: list[str] = []
    inboxes = {n: _RecordingInbox(handed, started=True) for n in range(1, 4)}

    async def scenario() -> float:
        first_tokens.work().begin()  # never released
        loop = asyncio.get_running_loop()
        began = loop.time()
        stream = multiplex_client.MultiplexCall(
            _ScriptedCall([_later_frames(3)]), inference_pb2.MultiplexRequest, "r", "r"
        )
        stream.inboxes.update(inboxes)
        await asyncio.wait_for(stream.done, 5)
        return loop.time() - began

    bound_before = multiplex_client.HOLDS.labels("bound")._value.get()
    took = asyncio.run(scenario())
    assert handed == ["token 1", "token 2", "token 3"]
    assert took >= 0.05
    assert multiplex_client.HOLDS.labels("bound")._value.get() == bound_before + 1


class _CallWithHeaders(_ScriptedCall):
    """A call whose headers come when ``headers`` resolves (never, if it does not), which
    notes what is written and ends the stream once something is."""

    def __init__(self, headers: asyncio.Future[tuple[()]]) -> None:
        super().__init__([])
        self.headers = headers
        self.asked = asyncio.Event()  # the writer waits for the headers
        self.written: list[inference_pb2.MultiplexRequest] = []
        self._wrote = asyncio.Event()

    async def initial_metadata(self) -> tuple[()]:
        self.asked.set()
        return await self.headers

    async def write(self, message: inference_pb2.MultiplexRequest) -> None:
        self.written.append(message)
        self._wrote.set()

    async def _replies(self) -> AsyncIterator[inference_pb2.MultiplexResponse]:
        await self._wrote.wait()  # then ends the stream: the scripted messages (none)
        for message in self._messages:
            yield message


def _headers_first(call: _CallWithHeaders) -> multiplex_client.MultiplexCall:
    stream = multiplex_client.MultiplexCall(
        call, inference_pb2.MultiplexRequest, "router", "router", headers_first=True
    )
    stream.send(inference_pb2.GenerationControl(generation_id=1, cancel=True))
    return stream


def test_with_headers_first_nothing_is_written_before_the_other_end_took_the_stream() -> None:
    async def scenario() -> list[inference_pb2.MultiplexRequest]:
        call = _CallWithHeaders(asyncio.get_running_loop().create_future())
        stream = _headers_first(call)
        async with asyncio.timeout(5):  # the writer, with a control to send, asks for them
            await call.asked.wait()
        assert call.written == []
        call.headers.set_result(())
        await stream.done
        return call.written

    written = asyncio.run(scenario())
    assert [len(message.controls) for message in written] == [1]


def test_with_headers_first_a_server_that_sends_none_still_gets_the_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(multiplex_client, "HEADERS_WAIT_S", 0.0)  # a router that sends none

    async def scenario() -> list[inference_pb2.MultiplexRequest]:
        # its headers would come with a response: never, here
        call = _CallWithHeaders(asyncio.get_running_loop().create_future())
        await _headers_first(call).done
        return call.written

    assert [len(message.controls) for message in asyncio.run(scenario())] == [1]

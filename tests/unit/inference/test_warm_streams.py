"""WarmStreams: which Triton stream a generation gets, and which are closed."""

from __future__ import annotations

import asyncio
import itertools

from services.inference.warm_streams import WarmStreams


class FakeStream:
    ids = itertools.count()

    def __init__(self, turns_to_end: int | None = 0) -> None:
        """``turns_to_end``: event-loop turns Triton takes to end the stream once
        half-closed (None: never)."""
        self.id = next(self.ids)
        self.ended = False
        self.half_closed = False
        self.turns_to_end = turns_to_end
        self.ended_by_triton = asyncio.Event()

    def done(self) -> bool:
        return self.ended

    async def done_writing(self) -> None:
        self.half_closed = True
        if self.turns_to_end is not None:
            self._end_in(self.turns_to_end)

    def _end_in(self, turns: int) -> None:
        if turns == 0:
            self.ended_by_triton.set()
        else:
            asyncio.get_running_loop().call_soon(self._end_in, turns - 1)

    async def code(self) -> str:
        await self.ended_by_triton.wait()
        return "OK"


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _pool(clock: Clock | None = None, max_idle: int = 4) -> WarmStreams[FakeStream]:
    return WarmStreams(FakeStream, max_idle=max_idle, idle_lifetime_s=10, clock=clock or Clock())


def test_a_stream_put_back_serves_the_next_generation() -> None:
    async def main() -> None:
        pool = _pool()
        first, was_idle = pool.take()
        assert not was_idle
        pool.put_back(first)
        again, was_idle = pool.take()
        assert again is first and was_idle
        other, was_idle = pool.take()
        assert other is not first and not was_idle

    asyncio.run(main())


def test_the_most_recently_used_stream_is_taken_first() -> None:
    async def main() -> None:
        pool = _pool()
        a, _ = pool.take()
        b, _ = pool.take()
        pool.put_back(a)
        pool.put_back(b)
        assert pool.take()[0] is b

    asyncio.run(main())


def test_a_stream_that_ended_while_idle_is_passed_over() -> None:
    async def main() -> None:
        pool = _pool()
        a, _ = pool.take()
        b, _ = pool.take()
        pool.put_back(a)
        pool.put_back(b)
        b.ended = True  # Triton went away, say
        assert pool.take() == (a, True)
        assert pool.idle == 0

    asyncio.run(main())


def test_idle_streams_beyond_the_limit_or_too_old_are_half_closed() -> None:
    async def main() -> None:
        clock = Clock()
        pool = _pool(clock, max_idle=2)
        streams = [pool.take()[0] for _ in range(3)]
        for stream in streams:
            clock.now += 1
            pool.put_back(stream)
        assert pool.idle == 2
        await pool.settle()
        assert [s.half_closed for s in streams] == [True, False, False]
        clock.now += 9.5  # the older of the two is now idle longer than 10 s
        assert pool.take()[0] is streams[2]
        await pool.settle()
        assert streams[1].half_closed and pool.idle == 0

    asyncio.run(main())


def test_discarded_and_remaining_streams_are_half_closed_never_reused() -> None:
    async def main() -> None:
        pool = _pool()
        bad, _ = pool.take()
        kept, _ = pool.take()
        pool.discard(bad)
        pool.put_back(kept)
        await pool.close()
        assert bad.half_closed and kept.half_closed and pool.idle == 0

    asyncio.run(main())


def test_closing_waits_until_triton_has_ended_the_half_closed_streams() -> None:
    """A channel closed before Triton ended a stream cancels it, and a finished stream
    cancelled keeps Triton from unloading its model at shutdown."""

    async def main() -> None:
        pool = WarmStreams(lambda: FakeStream(turns_to_end=20))
        stream, _ = pool.take()
        pool.put_back(stream)
        await asyncio.wait_for(pool.close(), 5)
        assert stream.half_closed and stream.ended_by_triton.is_set()

    asyncio.run(main())


def test_closing_gives_up_on_a_stream_that_triton_never_ends() -> None:
    async def main() -> None:
        pool = WarmStreams(lambda: FakeStream(turns_to_end=None))
        stream, _ = pool.take()
        pool.put_back(stream)
        await asyncio.wait_for(pool.close(wait_s=0.05), 5)
        assert stream.half_closed and not stream.ended_by_triton.is_set()

    asyncio.run(main())

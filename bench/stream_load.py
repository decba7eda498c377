"""A benchmark harness, never part of the product: long generations held open on one
GenerateStream call, as h2load holds Generate calls open in the capacity scenario
(bench/capacity.py), for a server's relay over a stream. Each generation that ends is
replaced at once by a new one, until the time is up; what ran then is cut, as h2load
cuts its calls.

Lean on purpose, so that the client is not what is measured: no coroutine per
generation, only a count of the frames of one reader and the starts written in reply.

Run as ``python -m bench.stream_load --server HOST:PORT --key KEY --generations N
--tokens T --seconds S --prompt P --out FILE``; FILE gets the generations served and
failed, and each served one's seconds from its start to its last response.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc

from llmmesh.client import auth_metadata, build_request
from llmmesh.v1 import generation_pb2, generation_pb2_grpc


@dataclass
class Held:
    """What the load saw."""

    served: int = 0
    failed: int = 0
    latencies_s: list[float] = field(default_factory=list)


class _Starts:
    """The start controls to write, each generation numbered once."""

    def __init__(self, request: generation_pb2.GenerateRequest) -> None:
        self._start = generation_pb2.GenerateStart(request=request)
        self._numbers: Iterator[int] = itertools.count(1)
        self.started_at: dict[int, float] = {}
        self.wanted: asyncio.Queue[int] = asyncio.Queue()  # how many to start, in batches

    def message(self, count: int) -> generation_pb2.GenerateStreamRequest:
        now = time.perf_counter()
        controls = []
        for _ in range(count):
            number = next(self._numbers)
            self.started_at[number] = now
            controls.append(generation_pb2.GenerateControl(generation_id=number, start=self._start))
        return generation_pb2.GenerateStreamRequest(controls=controls)

    async def messages(self, until: float) -> AsyncIterator[generation_pb2.GenerateStreamRequest]:
        while time.monotonic() < until:
            count = await self.wanted.get()
            while not self.wanted.empty():  # what finished together starts together
                count += self.wanted.get_nowait()
            yield self.message(count)


async def hold(
    server: str, key: str, generations: int, *, tokens: int, seconds: float, prompt: str
) -> Held:
    until = time.monotonic() + seconds
    request = build_request(prompt, model="llm", max_tokens=tokens, ignore_eos=True)
    starts, held = _Starts(request), Held()
    starts.wanted.put_nowait(generations)
    async with grpc.aio.insecure_channel(server) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        call = stub.GenerateStream(starts.messages(until), metadata=auth_metadata(key))
        try:
            async with asyncio.timeout(max(until - time.monotonic(), 0.0)):
                async for message in call:
                    ended = _ended(message, starts, held)
                    if ended:
                        starts.wanted.put_nowait(ended)
        except TimeoutError:
            call.cancel()  # the time is up: what runs is cut
    return held


def _ended(message: generation_pb2.GenerateStreamResponse, starts: _Starts, held: Held) -> int:
    """Counts the generations the message ends; returns how many ended."""
    ended = 0
    now = time.perf_counter()
    for frame in message.frames:
        if frame.HasField("error"):
            held.failed += 1
        elif frame.response.finish_reason:
            held.served += 1
            held.latencies_s.append(now - starts.started_at[frame.generation_id])
        else:
            continue
        del starts.started_at[frame.generation_id]
        ended += 1
    return ended


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--server", required=True)
    parser.add_argument("--key", default="")
    parser.add_argument("--generations", type=int, required=True)
    parser.add_argument("--tokens", type=int, required=True)
    parser.add_argument("--seconds", type=float, required=True)
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    held = asyncio.run(
        hold(
            args.server,
            args.key,
            args.generations,
            tokens=args.tokens,
            seconds=args.seconds,
            prompt=args.prompt,
        )
    )
    args.out.write_text(json.dumps(asdict(held)))


if __name__ == "__main__":
    main()

"""The paced replica's backend (a benchmark harness): tokens on its clock, scored as asked,
the same text for the same seed."""

from __future__ import annotations

import asyncio
import math

from bench.paced_replica import PacedBackend
from llmmesh.types import Chunk, FinishReason, InferenceCall, Sampling
from services.inference.triton import StreamGap


def generate(backend: PacedBackend, seed: int, logprobs: int | None = None) -> list[Chunk]:
    call = InferenceCall("r", "llm", "hi", Sampling(max_tokens=5, seed=seed, logprobs=logprobs))

    async def collect() -> list[Chunk]:
        return [chunk async for chunk in backend.generate(call)]

    return asyncio.run(collect())


def test_tokens_come_one_a_chunk_and_the_last_says_why() -> None:
    backend = PacedBackend(ttft_s=0.0, itl_s=0.0, max_context=2048)
    chunks = generate(backend, seed=1)
    assert [c.num_tokens for c in chunks] == [1] * 5 and all(not c.logprobs for c in chunks)
    assert [c.finish_reason for c in chunks] == [None] * 4 + [FinishReason.LENGTH]
    assert "".join(c.text for c in generate(backend, seed=1)) == "".join(c.text for c in chunks)
    assert backend.running == 0


def test_logprobs_name_the_token_and_its_top_alternatives() -> None:
    chunks = generate(PacedBackend(0.0, 0.0, 2048), seed=2, logprobs=3)
    for chunk in chunks:
        [scored] = chunk.logprobs
        assert scored.text == chunk.text and len(scored.top) == 3
        probabilities = [math.exp(lp) for _, _, lp in scored.top]
        assert probabilities == sorted(probabilities, reverse=True) and sum(probabilities) < 1


def test_running_sequences_share_each_step_as_in_an_engine() -> None:
    backend = PacedBackend(ttft_s=0.0, itl_s=0.001, max_context=2048)
    calls = [InferenceCall(f"r{i}", "llm", "hi", Sampling(max_tokens=5, seed=i)) for i in range(3)]

    async def together() -> list[list[Chunk]]:
        async def one(call: InferenceCall) -> list[Chunk]:
            return [chunk async for chunk in backend.generate(call)]

        return await asyncio.gather(*(one(c) for c in calls))

    streams = asyncio.run(together())
    assert [sum(c.num_tokens for c in s) for s in streams] == [5, 5, 5]
    assert backend.clock.steps == 4  # one step per token after the first, for all three


def test_with_a_stream_gap_later_tokens_go_together_and_the_text_is_the_same() -> None:
    """The first responses go a token each; then no sooner than the gap after the one
    before (here longer than any run: everything left goes with the last)."""
    gap = StreamGap(seconds=60.0, after=2)
    call = InferenceCall("r", "llm", "hi", Sampling(max_tokens=6, seed=3, logprobs=1))

    async def collect(backend: PacedBackend) -> list[Chunk]:
        return [chunk async for chunk in backend.generate(call)]

    gapped = asyncio.run(collect(PacedBackend(0.0, 0.0, 2048, gap)))
    alone = asyncio.run(collect(PacedBackend(0.0, 0.0, 2048)))
    assert [c.num_tokens for c in gapped] == [1, 1, 4]
    assert gapped[-1].finish_reason == FinishReason.LENGTH
    assert "".join(c.text for c in gapped) == "".join(c.text for c in alone)
    assert [lp for c in gapped for lp in c.logprobs] == [lp for c in alone for lp in c.logprobs]


def test_with_a_stream_gap_in_steps_a_response_carries_a_gap_of_steps() -> None:
    """A 4 ms gap over 1 ms steps: after the first two responses, four tokens a response,
    each one step; the last with what is left; the clock ticked once per token, and the
    sequence waited on it once per response."""
    backend = PacedBackend(0.0, 0.001, 2048, StreamGap(seconds=0.004, after=2))
    call = InferenceCall("r", "llm", "hi", Sampling(max_tokens=11, seed=4))
    waits: list[int] = []  # the steps of each wait on the clock: one wait per response
    step = backend.clock.step

    async def counted(count: int = 1) -> None:
        waits.append(count)
        await step(count)

    backend.clock.step = counted  # type: ignore[method-assign]

    async def collect() -> list[Chunk]:
        return [chunk async for chunk in backend.generate(call)]

    chunks = asyncio.run(collect())
    alone = generate(PacedBackend(0.0, 0.0, 2048), seed=4)  # the same seed, 5 tokens
    assert [c.num_tokens for c in chunks] == [1, 1, 4, 4, 1]
    assert [c.finish_reason for c in chunks] == [None] * 4 + [FinishReason.LENGTH]
    assert "".join(c.text for c in chunks).startswith("".join(c.text for c in alone))
    assert backend.clock.steps == 10
    assert waits == [1, 4, 4, 1]  # not woken at the steps between a gap's tokens

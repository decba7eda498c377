"""The inference service's Triton streams: kept open for the next generation once one
ends with its final response, never reused after a generation cut short, an error or an
overrun of the generation's time limit."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import cast

import pytest

from llmmesh.launcher import Stack
from llmmesh.runtime.errors import InvalidArgument, Unavailable
from llmmesh.types import Chunk, InferenceCall, Sampling
from services.inference.triton import TritonBackend
from tests.conftest import metric_value, wait_for

FINISHED = "llm_engine_requests_finished_total"


def _call(request_id: str, sampling: Sampling | None = None) -> InferenceCall:
    return InferenceCall(
        request_id, "llm", "the quick brown fox", sampling or Sampling(8, temperature=0.0)
    )


LONG = Sampling(100_000, temperature=0.0, ignore_eos=True)


async def _text(backend: TritonBackend, call: InferenceCall) -> str:
    return "".join([chunk.text async for chunk in backend.generate(call)])


def _with_backend(
    stack: Stack, scenario: Callable[[TritonBackend], Awaitable[None]], timeout_s: float = 60
) -> None:
    async def main() -> None:
        backend = TritonBackend(stack.address("triton_grpc"), timeout_s)
        try:
            await scenario(backend)
        finally:
            await backend.close()

    asyncio.run(main())


def test_generations_one_after_another_share_one_stream(stack: Stack) -> None:
    async def scenario(backend: TritonBackend) -> None:
        texts = [await _text(backend, _call(f"seq-{i}")) for i in range(4)]
        assert backend.idle_streams == 1  # one per generation would leave four
        assert len(set(texts)) == 1 and texts[0]  # greedy: a reused stream answers the same
        together = await asyncio.gather(*(_text(backend, _call(f"par-{i}")) for i in range(3)))
        assert together == texts[:3]
        assert backend.idle_streams == 3

    _with_backend(stack, scenario)


def test_a_generation_cut_short_cancels_its_stream_and_the_next_one_runs(stack: Stack) -> None:
    metrics = f"http://{stack.address('triton_metrics')}/metrics"
    labels = {"model": "llm", "reason": "cancelled"}
    cancelled_before = metric_value(metrics, FINISHED, labels)

    async def scenario(backend: TritonBackend) -> None:
        await _text(backend, _call("warm"))  # the stream the long one then reuses
        generation = cast(AsyncGenerator[Chunk, None], backend.generate(_call("long", LONG)))
        async for _ in generation:
            break
        await generation.aclose()
        assert backend.idle_streams == 0
        assert await _text(backend, _call("after"))
        assert backend.idle_streams == 1

    _with_backend(stack, scenario)
    wait_for(
        lambda: metric_value(metrics, FINISHED, labels) == cancelled_before + 1,
        what="the model to finish the cut-short request as cancelled",
    )


def test_a_refused_request_leaves_no_stream_behind(stack: Stack) -> None:
    async def scenario(backend: TritonBackend) -> None:
        with pytest.raises(InvalidArgument) as refused:
            await _text(backend, _call("bad", Sampling(8, top_p=7.0)))
        assert "top_p" in refused.value.field
        assert backend.idle_streams == 0
        assert await _text(backend, _call("good"))

    _with_backend(stack, scenario)


def test_a_generation_past_its_time_limit_ends_unavailable(stack: Stack) -> None:
    async def scenario(backend: TritonBackend) -> None:
        await _text(backend, _call("warm"))
        with pytest.raises(Unavailable, match="did not finish the stream in time"):
            await _text(backend, _call("slow", LONG))
        assert backend.idle_streams == 0
        assert await _text(backend, _call("after"))

    _with_backend(stack, scenario, timeout_s=0.3)

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator

import pytest

from llmmesh import structures
from llmmesh.runtime.errors import InvalidArgument
from llmmesh.types import Chunk, FinishReason, InferenceCall, ModelCard, Sampling
from services.inference.core import InferenceCore


class OneToken:
    async def generate(self, call: InferenceCall) -> AsyncIterator[Chunk]:
        yield Chunk("x", 1, FinishReason.LENGTH)

    async def describe(self, model: str) -> ModelCard:
        return ModelCard(model, max_context=2048)


def test_a_structure_is_compiled_off_the_loop_and_a_bad_one_refused_by_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A large schema compiles for tens of milliseconds: on the loop, every stream the
    replica relays would stall for it."""
    compiled_on: list[int] = []
    compile_error = structures._compile_error

    def recording(kind: str, spec: str) -> str:
        compiled_on.append(threading.get_ident())
        return compile_error(kind, spec)

    monkeypatch.setattr(structures, "_compile_error", recording)
    salt = "inference-core-test"  # a partition of its own: nothing kept from other tests
    good = InferenceCall("r", "llm", "hi", Sampling(4, structured=("regex", "[a-z]+")), None, salt)
    bad = InferenceCall("r", "llm", "hi", Sampling(4, structured=("regex", "(")), None, salt)

    async def scenario() -> tuple[int, list[Chunk], InvalidArgument]:
        core = InferenceCore(OneToken(), 64)
        chunks = [chunk async for chunk in core.generate(good)]
        with pytest.raises(InvalidArgument, match="does not compile") as refused:
            await anext(core.generate(bad))
        return threading.get_ident(), chunks, refused.value

    loop_thread, chunks, refused = asyncio.run(scenario())
    assert [c.text for c in chunks] == ["x"] and refused.field == "sampling.structured_output"
    assert len(compiled_on) == 2 and loop_thread not in compiled_on


def test_a_negative_token_id_is_refused_naming_the_field() -> None:
    call = InferenceCall("r", "llm", "hi", Sampling(4), prompt_ids=(104, -1))

    async def scenario() -> InvalidArgument:
        with pytest.raises(InvalidArgument) as refused:
            await anext(InferenceCore(OneToken(), 64).generate(call))
        return refused.value

    assert asyncio.run(scenario()).field == "prompt_token_ids"

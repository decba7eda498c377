from __future__ import annotations

import dataclasses

from llmmesh.types import (
    Chunk,
    FinishReason,
    Route,
    TokenLogprob,
)


def test_a_chunk_with_other_text_is_the_chunk_replace_would_make() -> None:
    chunk = Chunk(
        "held back",
        num_tokens=3,
        finish_reason=FinishReason.LENGTH,
        route=Route("10.0.0.1:50061", "stable", "eu", False),
        resumed=1,
        logprobs=(TokenLogprob(1, "a", -0.5, 1, ()),),
        cached_tokens=2,
    )
    let_out = chunk.with_text("held")
    assert let_out == dataclasses.replace(chunk, text="held")
    assert isinstance(let_out, Chunk)
    assert chunk.text == "held back"  # the original is left as it was

from __future__ import annotations

import dataclasses

import pytest

from llmmesh.runtime.errors import InvalidArgument
from llmmesh.types import (
    Chunk,
    FinishReason,
    Route,
    TokenLogprob,
    _structure_error,
    check_structure,
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


@pytest.mark.parametrize(
    ("kind", "spec", "reason"),
    [
        ("json_schema", '{"type": "nonsense"}', "does not compile"),
        ("json_schema", "[1]", "a JSON schema is an object"),
        ("json_schema", "{", "not a json schema"),
        ("json_schema", '{"a": ' * 3000 + "1" + "}" * 3000, "not a json schema"),
        ("regex", "(", "does not compile"),
        ("grammar", "x", "one of json_schema, json_object, regex"),
        ("regex", "a" * 70_000, "at most 65536 characters"),
    ],
)
def test_a_structure_that_does_not_compile_is_refused_naming_the_field(
    kind: str, spec: str, reason: str
) -> None:
    with pytest.raises(InvalidArgument, match=reason) as refused:
        check_structure(kind, spec)
    assert refused.value.field == "sampling.structured_output"


def test_a_structure_that_compiles_passes() -> None:
    check_structure("json_schema", '{"type": "object", "properties": {"a": {"type": "integer"}}}')
    check_structure("json_object", "")
    check_structure("regex", "[0-9]{3}")


def test_a_structure_checked_for_one_partition_is_checked_anew_for_another() -> None:
    """A shared cache would answer a tenant faster for a schema another tenant sent."""
    spec = '{"type": "object", "properties": {"partitioned": {"type": "string"}}}'
    misses = _structure_error.cache_info().misses
    check_structure("json_schema", spec, partition="tenant-a")
    check_structure("json_schema", spec, partition="tenant-a")
    assert _structure_error.cache_info().misses == misses + 1
    check_structure("json_schema", spec, partition="tenant-b")
    assert _structure_error.cache_info().misses == misses + 2

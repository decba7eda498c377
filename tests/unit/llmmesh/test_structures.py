from __future__ import annotations

import asyncio
import re
from typing import Any

import pytest

from llmmesh import structures
from llmmesh.runtime.errors import InvalidArgument
from llmmesh.structures import (
    CHECKED,
    CachePartition,
    StructureChecks,
    check_structure,
    choice_spec,
)

A, B = CachePartition("tenant:a"), CachePartition("tenant:b")


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
        ("choice", "[]", "one option or more"),
        ("choice", '["a", ""]', "an option is empty"),
        ("choice", '["a", 1]', "an option is empty or not a text"),
        ("choice", '"a"', "one option or more"),
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
    check_structure("choice", choice_spec(["a.b", "(c)|d", "x-y/z", "[e]{1}", "\\", "é"]))


def test_a_choice_matches_its_options_and_nothing_else() -> None:
    """The pattern the check compiles: each option exactly, its special characters
    literal (the engine builds the same)."""
    options = ["a.b", "(c)|d", "x-y/z", "[e]{1}+?*^$", "\\", "é"]
    pattern = re.compile(structures._choice_pattern(options))
    assert all(pattern.fullmatch(o) for o in options)
    assert not any(pattern.fullmatch(t) for t in ["axb", "c", "d", "(c)", "e", "x-y", ""])


def test_a_structure_checked_for_one_partition_is_checked_anew_for_another() -> None:
    """A shared cache would answer a tenant faster for a schema another tenant sent."""
    spec = '{"type": "object", "properties": {"partitioned": {"type": "string"}}}'
    compiled = CHECKED.compiled
    check_structure("json_schema", spec, partition=A)
    check_structure("json_schema", spec, partition=A)
    assert CHECKED.compiled == compiled + 1
    check_structure("json_schema", spec, partition=B)
    check_structure("json_schema", spec, partition=A._replace(salt="a user's salt"))
    assert CHECKED.compiled == compiled + 3


def test_one_groups_new_structures_never_evict_anothers() -> None:
    checks = StructureChecks(per_group=2)
    checks.error(A, "regex", "[a-z]+")
    for n in range(5):
        checks.error(B, "regex", f"[0-9]{{{n + 1}}}")
    assert checks.kept(A, "regex", "[a-z]+")
    # B keeps its own most recent two
    kept = [checks.kept(B, "regex", f"[0-9]{{{n + 1}}}") for n in range(5)]
    assert kept == [False, False, False, True, True]


def test_the_groups_kept_are_bounded_the_least_recent_going_first() -> None:
    checks = StructureChecks(groups=2)
    for group in (A, B):
        checks.error(group, "regex", "x")
    assert checks.kept(A, "regex", "x")  # A is now the more recent
    checks.error(CachePartition("tenant:c"), "regex", "x")
    assert checks.kept(A, "regex", "x") and not checks.kept(B, "regex", "x")


def test_a_kept_structure_is_not_compiled_again_nor_sent_to_a_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A worker thread's hop costs about 0.2 ms: only a structure not yet kept takes it."""
    hops: list[Any] = []
    real = asyncio.to_thread

    async def counted(function: Any, *args: Any) -> Any:
        hops.append(function)
        return await real(function, *args)

    monkeypatch.setattr(asyncio, "to_thread", counted)
    structure = ("json_schema", '{"type": "object", "properties": {"hop": {"type": "null"}}}')
    partition = CachePartition("tenant:hops")
    for _ in range(3):
        asyncio.run(structures.compile_structure(structure, partition))
    assert len(hops) == 1 and CHECKED.kept(partition, *structure)

"""docs/architecture.md's three extension examples run as written (each registers its
plugin, detector or store, and asserts what it shows)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from llmmesh.policy import DETECTORS
from services.context.stores import STORES
from services.router.scheduling import SCORERS

DOC = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"
EXAMPLES = re.findall(
    r"## Extension point \d: ([^\n]+).*?```python\n(.*?)```", DOC.read_text(), re.S
)


@pytest.fixture(autouse=True)
def registries_restored() -> Iterator[None]:
    """What an example registers is gone after it."""
    registries: list[dict[str, Any]] = [SCORERS, DETECTORS, STORES]
    saved = [dict(r) for r in registries]
    yield
    for registry, before in zip(registries, saved, strict=True):
        registry.clear()
        registry.update(before)


def test_the_document_has_its_three_examples() -> None:
    assert [name for name, _ in EXAMPLES] == [
        "a scheduling plugin",
        "a policy detector",
        "a session store",
    ]
    assert all(len(code.splitlines()) <= 45 for _, code in EXAMPLES)


@pytest.mark.parametrize(("name", "code"), EXAMPLES, ids=[n for n, _ in EXAMPLES])
def test_an_extension_example_runs(name: str, code: str) -> None:
    exec(compile(code, f"docs/architecture.md: {name}", "exec"), {"__name__": "example"})

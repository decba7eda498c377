"""The committed generated code matches what `make protos` produces from protos/."""

from __future__ import annotations

from pathlib import Path

from llmmesh.codegen import REPO, generate


def test_generated_code_is_current(tmp_path: Path) -> None:
    fresh = generate(tmp_path)
    assert fresh, "protoc produced nothing"
    committed = REPO / "llmmesh" / "v1"
    for path in fresh:
        current = committed / path.name
        assert current.exists(), f"{path.name} is missing: run `make protos`"
        assert current.read_bytes() == path.read_bytes(), f"{path.name} is stale: run `make protos`"
    stale = {p.name for p in committed.glob("*_pb2*")} - {p.name for p in fresh}
    assert not stale, f"generated files without a proto: {stale}"

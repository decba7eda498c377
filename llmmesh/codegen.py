"""Regenerates the Python code for protos/ (``make protos``); a test checks it is current."""

from __future__ import annotations

import sys
from importlib import resources
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO / "protos"


def proto_files() -> list[Path]:
    return sorted((PROTO_ROOT / "llmmesh" / "v1").glob("*.proto"))


def generate(out_dir: Path) -> list[Path]:
    """Writes *_pb2.py, *_pb2_grpc.py and their .pyi stubs under ``out_dir``."""
    from grpc_tools import protoc

    well_known = resources.files("grpc_tools") / "_proto"
    # mypy-protobuf's plugins (typed stubs for messages and for grpc.aio stubs/servicers).
    bindir = Path(sys.executable).parent
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{well_known}",
        f"--plugin=protoc-gen-mypy={bindir / 'protoc-gen-mypy'}",
        f"--plugin=protoc-gen-mypy_grpc={bindir / 'protoc-gen-mypy_grpc'}",
        f"--python_out={out_dir}",
        f"--mypy_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        f"--mypy_grpc_out={out_dir}",
        *(str(p.relative_to(PROTO_ROOT)) for p in proto_files()),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed")
    return sorted((out_dir / "llmmesh" / "v1").glob("*_pb2*.py*"))


def main() -> int:
    written = generate(REPO)
    print(f"generated {len(written)} files into llmmesh/v1/", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

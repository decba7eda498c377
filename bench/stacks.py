"""The stacks a benchmark starts, and the CPU groups of their processes."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from bench.cpu import CpuMeter, place
from bench.policy import input_rules_tenant


@contextlib.contextmanager
def bench_stack(args: argparse.Namespace, code: Path | None) -> Iterator[Any]:
    """A local stack of the tiny model (or the --model asked for), on this checkout's
    code or on ``code``'s (another checkout: its services, and its model repository)."""
    from llmmesh.launcher import Stack, StackPorts

    with tempfile.TemporaryDirectory(prefix="llm-mesh-bench-") as workdir:
        models = [args.model] if args.model else ["llm"]
        env = input_rules_tenant(Path(workdir)) if args.rules == "input" else {}
        if code is None:
            stack = Stack(Path(workdir), StackPorts.free(), models=models, env=env)
        else:
            root = code.resolve()
            stack = Stack(
                Path(workdir), StackPorts.free(), models=models,
                model_repository=root / "model_repository", env={**env, "PYTHONPATH": str(root)},
            )  # fmt: skip
        print(f"starting a local stack on {code or 'this checkout'} ...", file=sys.stderr)
        with stack:
            yield stack


LOADGEN = "load generator"


def stack_meter(stack: Any, router: Any = None) -> CpuMeter:
    """The stack's processes in CPU groups (each inference replica in one), and this one;
    ``router``: a router whose endpoint is Triton itself, in the router's place, with no
    inference group (the stack's inference service is not on its path; it only reads
    Triton's metrics page more often while that router keeps the engine busy)."""
    groups: dict[str, list[int]] = {LOADGEN: [os.getpid()]}
    for name, pid in stack.pids().items():
        groups.setdefault("inference" if name.startswith("inference") else name, []).append(pid)
    if router is not None:
        groups["router"] = [router.process.pid]
        del groups["inference"]
    return CpuMeter(groups, alone=[LOADGEN])  # the stack's processes are its children


@contextlib.contextmanager
def router_to_triton(stack: Any) -> Iterator[tuple[str, Any]]:
    """A second router beside the stack's, its one endpoint the stack's Triton itself
    (services/router/triton_link.py), and its address; the stack's inference service
    idles meanwhile."""
    from llmmesh.launcher import StackPorts

    endpoint = {
        "address": stack.address("triton_grpc"),
        "triton_metrics_url": f"http://{stack.address('triton_metrics')}/metrics",
        "region": "local",
    }
    endpoints = stack.workdir / "endpoints-triton.json"
    endpoints.write_text(json.dumps({"endpoints": [endpoint]}))
    port = StackPorts.free().router
    router = stack.start_service("router", port, stack.workdir, endpoints_file=str(endpoints))
    try:
        yield f"{stack.host}:{port}", router
    finally:
        router.terminate(5)


def placed(placement: str, meters: Iterable[CpuMeter]) -> str:
    engine = [pid for meter in meters for pid in meter.roots.get("triton", ())]
    mesh = [
        pid for meter in meters for name, pids in meter.roots.items()
        if name not in ("triton", LOADGEN)  # this process, whose children include Triton
        for pid in pids
    ]  # fmt: skip
    return place(placement, engine, mesh)

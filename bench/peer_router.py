"""vllm-router (the vLLM project's router: Rust, from PyPI) as a peer to measure against.

It fronts OpenAI-compatible workers that answer ``/health``; the mesh's router is one.
``--scenario peer-hop`` measures what its hop costs: client -> vllm-router -> a router
over the stack's replica, against client -> that router, request by request in pairs
(the order alternating), both through the OpenAI HTTP API. ``--scenario peer-routing``
measures its routing: vllm-router over one router per engine (each router over a single
replica) against the mesh's own picker over the same engines, the routing scenario's
sessions sent to both by a client that keeps the history.

The tool lives in a virtual environment of its own (``.llm-mesh/tools``), kept out of the
mesh's; nothing of it is changed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from bench.routing import replica_fleet, router_settings, triton_metrics_url
from llmmesh.launcher.process import Child, free_ports

TOOL, VERSION = "vllm-router", "0.1.17"
TOOLS_DIR = Path(".llm-mesh") / "tools"
POLICIES = ("random", "round_robin", "cache_aware", "power_of_two", "consistent_hash")


def tool_command(root: Path = TOOLS_DIR) -> Path:
    """The router's command, installed first if it is not yet."""
    venv = root / f"{TOOL}-{VERSION}"
    command = venv / "bin" / TOOL
    if not command.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
        subprocess.run([*pip, f"{TOOL}=={VERSION}"], check=True)
    return command.resolve()


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as reply:
            return bool(reply.status == 200)
    except OSError:
        return False


@contextmanager
def peer_router(workers: Sequence[str], policy: str, workdir: Path) -> Iterator[str]:
    """vllm-router over ``workers`` (base URLs without /v1) with ``policy``; yields its
    base URL (with /v1) once it answers."""
    if policy not in POLICIES:
        raise ValueError(f"policy: one of {POLICIES}")
    port = free_ports(1)[0]
    command = [
        str(tool_command()),
        "--host", "127.0.0.1", "--port", str(port),
        "--worker-urls", *workers,
        "--policy", policy,
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_ports(1)[0]),
        "--log-level", "warning",
    ]  # fmt: skip
    child = Child.spawn(TOOL, command, dict(os.environ), workdir / f"{TOOL}.log", workdir)
    try:
        child.wait_until(
            lambda: _healthy(f"http://127.0.0.1:{port}/health"),
            time.monotonic() + 60,
            "answer /health",
        )
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        child.terminate(5)


@contextmanager
def peer_routing_fleet(
    workdir: Path, policy: str, engine_cpu: float | None = None
) -> Iterator[tuple[dict[str, str], str, str]]:
    """The routing scenario's replicas, behind the mesh's picker (one router over all of
    them) and behind vllm-router with ``policy`` over one router per replica; yields the
    OpenAI base URL of each (by picker), the sessions' tenant's API key and Triton's
    metrics URL. Every router runs as deployed (admission control, the tenant's rules).
    ``engine_cpu``: as ``replica_fleet``'s."""
    with replica_fleet(workdir, engine_cpu) as (stack, replicas, tenants, api_key, children):

        def router(name: str, over: list[str]) -> str:
            grpc_port, http_port = free_ports(2)
            settings = router_settings(
                workdir, name, over, "llm_aware", tenants, engine_cpu=engine_cpu
            )
            children.append(
                stack.start_service(
                    "router", grpc_port, workdir, http_port=str(http_port), **settings
                )
            )
            return f"http://127.0.0.1:{http_port}"

        mesh = router("llm_aware", replicas)
        workers = [router(f"single-{n}", [replica]) for n, replica in enumerate(replicas)]
        with peer_router(workers, policy, workdir) as fronted:
            urls = {"llm_aware": f"{mesh}/v1", f"vllm-router {policy}": fronted}
            yield urls, api_key, triton_metrics_url(stack)

"""`llm-mesh canary rollout` run to its end against a real router of the stack under load,
with shadow traffic: a canary with stable's own weights is promoted to 100%; the stack's
canary (the tiny model with another seed's weights) fails the drift gates and is rolled
back to 0 in the interval that saw it."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import grpc
import yaml

from llmmesh.client import authorized_channel
from llmmesh.launcher import Stack, StackPorts
from tests.conftest import collect, start_service

ROUTING = """\
split: {stable: 100, canary: 0}
colors: {stable: stable, canary: canary}
mirror: {subset: canary, percent: 100, max_in_flight: 4}
"""
# Small windows: the gates' logic is the same as at 50 samples, the test is seconds long.
FAST = [
    "--interval", "1s", "--min-samples", "5", "--min-pairs", "5", "--max-wait", "20",
    "--latency-tolerance", "1.0", "--error-tolerance", "0.2",
]  # fmt: skip


class Load:
    """Requests one after another on a thread, until stopped."""

    def __init__(self, address: str, key: str) -> None:
        self._stop = threading.Event()
        self.subsets: list[str] = []
        self._thread = threading.Thread(target=self._run, args=(address, key), daemon=True)

    def __enter__(self) -> Load:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(30)

    def _run(self, address: str, key: str) -> None:
        with authorized_channel(address, key) as channel:
            i = 0
            while not self._stop.is_set():
                i += 1
                try:
                    last = collect(channel, f"question {i}", max_tokens=6, ignore_eos=True)[-1]
                except grpc.RpcError:
                    continue
                self.subsets.append(last.served.subset)


def rollout(stack: Stack, tmp: Path, endpoints: list[dict[str, str]], steps: str) -> dict[str, Any]:
    (tmp / "routing.yaml").write_text(ROUTING)
    (tmp / "endpoints.json").write_text(json.dumps({"endpoints": endpoints}))
    ports = StackPorts.free()
    router = start_service(
        stack,
        "router",
        ports.router,
        tmp,
        routing_file=str(tmp / "routing.yaml"),
        endpoints_file=str(tmp / "endpoints.json"),
        http_port=str(ports.router_http),
        watch_interval_s="0.1",
    )
    try:
        with Load(f"127.0.0.1:{ports.router}", stack.api_key) as load:
            done = subprocess.run(
                [
                    sys.executable, "-m", "llmmesh.cli", "canary", "rollout", "--model", "llm",
                    "--steps", steps, *FAST, "--routing-file", str(tmp / "routing.yaml"),
                    "--router-http", f"127.0.0.1:{ports.router_http}",
                    "--token-file", str(stack.internal_token_file),
                ],
                capture_output=True, text=True, timeout=120, check=False,
            )  # fmt: skip
    finally:
        router.terminate(5)
    status = json.loads((tmp / "routing.yaml.rollout.json").read_text())
    split = yaml.safe_load((tmp / "routing.yaml").read_text())["split"]
    return {"code": done.returncode, "out": done.stdout + done.stderr, "status": status,
            "split": split, "subsets": load.subsets}  # fmt: skip


def _endpoint(address: str, version: str) -> dict[str, str]:
    return {"address": address, "version": version, "region": "local"}


def test_a_canary_with_stables_weights_is_promoted(stack: Stack, tmp_path: Path) -> None:
    """The canary replica here serves the stable model itself: same answers, agreement 1."""
    port = StackPorts.free().inference
    twin = start_service(stack, "inference", port, tmp_path)
    try:
        endpoints = [
            _endpoint(stack.address("inference"), "stable"),
            _endpoint(f"127.0.0.1:{port}", "canary"),
        ]
        result = rollout(stack, tmp_path, endpoints, "50,100")
    finally:
        twin.terminate(5)
    assert result["code"] == 0, result["out"]
    assert result["split"]["canary"] == 100 and result["split"]["stable"] == 0
    states = [h["state"] for h in result["status"]["history"]]
    assert states[-1] == "promoted" and "passed" in states
    passed = next(h for h in result["status"]["history"] if h["state"] == "passed")
    assert passed["weight"] == 50
    assert "canary" in result["subsets"]  # it served real traffic at 50%


def test_a_canary_that_answers_otherwise_is_rolled_back(stack: Stack, tmp_path: Path) -> None:
    endpoints = [
        _endpoint(stack.address("inference"), "stable"),
        _endpoint(stack.address("inference_canary"), "canary"),  # another seed's weights
    ]
    result = rollout(stack, tmp_path, endpoints, "25,50,100")
    assert result["code"] == 4, result["out"]
    assert result["split"]["canary"] == 0 and result["split"]["stable"] == 100
    status = result["status"]
    assert status["state"] == "rolled_back" and status["step"] == 1
    failed = {g["gate"] for g in status["gates"] if g["verdict"] == "fail"}
    assert "agreement" in failed, status["gates"]
    # Rolled back in the interval whose window first held enough pairs: no verdict of
    # "passed" on the way, and the waits before it were for samples.
    states = [h["state"] for h in status["history"]]
    assert states[0] == "running" and states[-1] == "rolled_back"
    assert set(states[1:-1]) <= {"waiting"}

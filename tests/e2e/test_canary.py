"""`llm-mesh canary set/status` against a real router of the stack."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from llmmesh.client import authorized_channel
from llmmesh.launcher import Stack, StackPorts
from tests.conftest import collect, start_service


def canary(*args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "llmmesh.cli", "canary", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return done.stdout


def test_a_weight_change_applies_within_a_second_and_status_shows_the_share(
    stack: Stack, tmp_path: Path
) -> None:
    routing = tmp_path / "routing.yaml"
    routing.write_text("split: {stable: 100, canary: 0}\n")
    ports = StackPorts.free()
    router = start_service(
        stack,
        "router",
        ports.router,
        tmp_path,
        routing_file=str(routing),
        metrics_port=str(ports.router_metrics),
        watch_interval_s="0.1",
    )
    address = f"127.0.0.1:{ports.router}"
    metrics = f"http://127.0.0.1:{ports.router_metrics}/metrics"
    try:
        with authorized_channel(address, stack.api_key) as channel:

            def subset() -> str:
                return collect(channel, "hi", max_tokens=1)[-1].served.subset

            assert {subset() for _ in range(4)} == {"stable"}
            assert "canary=100" in canary(
                "set", "--weight", "canary=100", "--routing-file", str(routing)
            )
            written = time.monotonic()
            while subset() != "canary":
                assert time.monotonic() - written < 1.0, "the new split did not apply in 1 s"
            for _ in range(3):
                assert subset() == "canary"
        status = canary("status", "--routing-file", str(routing), "--router-metrics", metrics)
        rows = {line.split()[0]: line.split()[1:] for line in status.splitlines()[2:]}
        assert rows["canary"][0] == "100.0%" and rows["stable"][0] == "0.0%"
        assert float(rows["canary"][2]) >= 4 and float(rows["stable"][2]) >= 4
    finally:
        router.terminate(5)

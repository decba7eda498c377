"""The region drill: the router's own region is cut off under load (packets to its
replica dropped, so its connections stay open and silent, as in a real partition), and
comes back. Requests that had not started streaming must all be answered, by the other
region; after the heal the router's own region serves again. Figures go to
bench/results/partition.json and docs/reliability.md.

This machine's kernel has no netem qdisc (latency, loss); the partition is an iptables
DROP of the replica's port on loopback."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmmesh.client import authorized_channel
from llmmesh.launcher import Stack, StackPorts
from llmmesh.launcher.process import Child
from tests.chaos.load import Load
from tests.conftest import collect, start_service, wait_for

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results" / "partition.json"
PARTITION_S = 8.0  # how long the region stays cut off, under load


@pytest.fixture(scope="module")
def regions(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, str, str]]:
    """The stack, and a router in region eu whose replicas are the stack's stable one
    (eu) and its second one (us); the router's address and the eu replica's."""
    tmp = tmp_path_factory.mktemp("partition")
    with Stack(tmp / "stack", StackPorts.free()) as stack:
        eu, us = stack.address("inference"), stack.address("inference_canary")
        endpoints = [
            {"address": eu, "version": "stable", "region": "eu"},
            {"address": us, "version": "stable", "region": "us"},
        ]
        (tmp / "endpoints.json").write_text(json.dumps({"endpoints": endpoints}))
        (tmp / "routing.yaml").write_text("split: {stable: 100}\nregions: [eu, us]\n")
        port = StackPorts.free().router
        router: Child = start_service(
            stack,
            "router",
            port,
            tmp,
            endpoints_file=str(tmp / "endpoints.json"),
            routing_file=str(tmp / "routing.yaml"),
            region="eu",
        )
        try:
            yield stack, f"127.0.0.1:{port}", eu
        finally:
            router.terminate(10)


def _iptables(action: str, port: str) -> None:
    for direction in ("--dport", "--sport"):
        rule = ["-i", "lo", "-p", "tcp", direction, port, "-j", "DROP"]
        subprocess.run(["iptables", action, "INPUT", *rule], check=True)


def served_region(router: str, key: str) -> str:
    with authorized_channel(router, key) as channel:
        return str(collect(channel, "where?", max_tokens=2)[-1].served.region)


def test_a_partitioned_region_costs_no_request_that_had_not_streamed(
    regions: tuple[Stack, str, str],
) -> None:
    stack, router, eu = regions
    assert served_region(router, stack.api_key) == "eu"
    load = Load(router, stack.api_key)
    load.start()
    port = eu.rsplit(":", 1)[1]
    try:
        wait_for(lambda: sum(o.acknowledged for o in load.outcomes) >= 8, 60, "warm load")
        cut_at = time.monotonic()
        _iptables("-A", port)
        try:
            wait_for(lambda: time.monotonic() - cut_at >= PARTITION_S, PARTITION_S + 5, "hold")
        finally:
            _iptables("-D", port)
        healed_at = time.monotonic()
        wait_for(lambda: served_region(router, stack.api_key) == "eu", 60, "eu serving again")
        back_after = time.monotonic() - healed_at
    finally:
        load.stop()
    during = [o for o in load.outcomes if o.ended_at >= cut_at]
    figures = {
        "partition_s": PARTITION_S,
        "requests": len(during),
        "not_streaming_failed": sum(not o.acknowledged and not o.cut for o in during),
        "cut_mid_stream": sum(o.cut for o in during),
        "answered": sum(o.acknowledged for o in during),
        "slowest_answer_s": round(max((o.ended_at - o.started_at) for o in during), 2),
        "eu_serving_again_after_heal_s": round(back_after, 2),
        "statuses": sorted({f"{o.code}: {o.detail}" for o in during if not o.acknowledged}),
        "slowest": sorted(
            (
                [round(o.started_at - cut_at, 2), round(o.ended_at - o.started_at, 2)]
                for o in during
            ),
            key=lambda pair: -pair[1],
        )[:5],  # [sent, seconds from the cut; took, seconds]
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(figures, indent=2) + "\n")
    assert figures["not_streaming_failed"] == 0, figures
    assert figures["cut_mid_stream"] == 0, figures  # moved to the other region, whole

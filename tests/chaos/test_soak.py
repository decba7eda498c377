"""The soak run: the stack at 70% of its capacity for LLM_MESH_SOAK_S seconds (30 minutes
by default), sampling every process's memory and file descriptors, the router's open
streams and the engine's KV blocks; no request may fail, and none of them may grow
with time. Figures go to bench/results/soak.json, curves to docs/img/soak-*.png."""

from __future__ import annotations

import json
import os
import random
import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import matplotlib
import pytest
from prometheus_client.parser import text_string_to_metric_families

from llmmesh.launcher import Stack, StackPorts
from llmmesh.waiting import poll_until
from tests.chaos.load import Load, Outcome
from tests.conftest import backend_pids

matplotlib.use("Agg")
import matplotlib.pyplot as plt

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results" / "soak.json"
DURATION_S = float(os.environ.get("LLM_MESH_SOAK_S", "1800"))
SAMPLE_EVERY_S = 10.0
LOAD_SHARE = 0.7
# Conversations of a few turns, so that the load is steady: a history that grew for the
# whole run would make the last requests several times the first ones.
TURNS_PER_SESSION = 4
CAPACITY_ANSWERS = 400
CAPACITY_WINDOW_S = 20.0


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with Stack(tmp_path_factory.mktemp("soak"), StackPorts.free()) as stack:
        yield stack


def processes(stack: Stack) -> dict[str, int]:
    """The stack's processes and Triton's backend stubs, by name."""
    stubs = {f"stub {instance}": pid for instance, pid in backend_pids(stack).items()}
    return {**stack.pids(), **stubs}


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def metric_sum(url: str, name: str) -> float:
    with urllib.request.urlopen(url, timeout=5) as reply:
        text = reply.read().decode()
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name
    )


def sample(stack: Stack, pids: dict[str, int], started: float) -> dict[str, Any]:
    return {
        "t": round(time.monotonic() - started, 1),
        "rss_mb": {name: round(rss_mb(pid), 1) for name, pid in pids.items()},
        "fds": {name: len(os.listdir(f"/proc/{pid}/fd")) for name, pid in pids.items()},
        "router_streams": metric_sum(
            f"http://{stack.address('router_metrics')}/metrics", "llm_router_endpoint_in_flight"
        ),
        "kv_blocks_used": metric_sum(
            f"http://{stack.address('triton_metrics')}/metrics", "llm_engine_kv_blocks_used"
        ),
    }


def capacity(stack: Stack) -> float:
    """Requests per second the stack answers with 16 clients back to back: over its first
    CAPACITY_ANSWERS answers, or CAPACITY_WINDOW_S if it answers fewer by then."""
    load = Load(
        stack.address("router"), stack.api_key, workers=16, turns_per_session=TURNS_PER_SESSION
    )

    def answered() -> int:
        return sum(o.acknowledged for o in list(load.outcomes))

    started = time.monotonic()
    load.start()
    poll_until(lambda: answered() >= CAPACITY_ANSWERS, CAPACITY_WINDOW_S, interval_s=0.2)
    count, elapsed = answered(), time.monotonic() - started
    load.stop()
    return count / elapsed


def open_loop(stack: Stack, rate: float, until: float) -> list[Outcome]:
    """Poisson arrivals at ``rate``, each a turn of a session of its own, until ``until``."""
    load = Load(stack.address("router"), stack.api_key)
    outcomes: list[Outcome] = []
    lock = threading.Lock()
    rng = random.Random(0)

    def one(n: int) -> None:
        outcome = load.ask(f"soak-{n // TURNS_PER_SESSION}", f"turn {n}: go on")
        with lock:
            outcomes.append(outcome)

    with ThreadPoolExecutor(max_workers=64) as pool:
        n, arrival = 0, time.monotonic()
        while arrival < until:
            pool.submit(one, n)
            n += 1
            # Each arrival at its own time on one Poisson schedule: a loaded machine's
            # slower submits delay an arrival, not every arrival after it.
            arrival += rng.expovariate(rate)
            time.sleep(max(0.0, arrival - time.monotonic()))  # until the next arrival
    return outcomes


def plot(samples: list[dict[str, Any]]) -> None:
    times = [s["t"] / 60 for s in samples]
    for key, unit in (("rss_mb", "RSS (MB)"), ("fds", "open file descriptors")):
        figure, axes = plt.subplots(figsize=(7, 3.5))
        for name in samples[0][key]:
            axes.plot(times, [s[key].get(name, 0) for s in samples], label=name)
        axes.set_xlabel("minutes")
        axes.set_ylabel(unit)
        axes.legend(fontsize=6, ncol=3)
        figure.tight_layout()
        figure.savefig(ROOT / "docs" / "img" / f"soak-{key.replace('_', '-')}.png", dpi=110)
        plt.close(figure)
    figure, axes = plt.subplots(figsize=(7, 3.5))
    axes.plot(times, [s["router_streams"] for s in samples], label="router streams open")
    axes.plot(times, [s["kv_blocks_used"] for s in samples], label="KV blocks in use")
    axes.set_xlabel("minutes")
    axes.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(ROOT / "docs" / "img" / "soak-streams-kv.png", dpi=110)
    plt.close(figure)


@pytest.mark.timeout(DURATION_S + 600)
def test_soak_at_70_percent_of_capacity(stack: Stack) -> None:
    rate = LOAD_SHARE * capacity(stack)
    pids = processes(stack)
    started = time.monotonic()
    samples = [sample(stack, pids, started)]
    outcomes: list[Outcome] = []
    loading = threading.Thread(
        target=lambda: outcomes.extend(open_loop(stack, rate, started + DURATION_S))
    )
    loading.start()
    while loading.is_alive():
        loading.join(SAMPLE_EVERY_S)
        samples.append(sample(stack, pids, started))
    failed = [o for o in outcomes if not o.acknowledged]
    half = len(samples) // 2
    growth = {
        name: round(samples[-1]["rss_mb"][name] - samples[half]["rss_mb"][name], 1) for name in pids
    }
    figures = {
        "duration_s": DURATION_S,
        "rate_per_s": round(rate, 2),
        "requests": len(outcomes),
        "failed": len(failed),
        "statuses": sorted({f"{o.code}: {o.detail}" for o in failed}),
        "rss_growth_second_half_mb": growth,
        "fds_first_last": {n: (samples[1]["fds"][n], samples[-1]["fds"][n]) for n in pids},
        "router_streams_at_end": samples[-1]["router_streams"],
        "samples": samples,
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(figures, indent=2) + "\n")
    plot(samples)
    assert not failed, figures["statuses"]
    assert samples[-1]["router_streams"] == 0
    assert all(last - first <= 8 for first, last in figures["fds_first_last"].values())

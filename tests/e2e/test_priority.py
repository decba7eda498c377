"""A tenant's tier reaches the engine as its scheduling priority, through the router, the
inference service and real Triton: with the engine full of a sheddable tenant's long
generations, a critical request preempts one and gets its first token about as fast as
on an idle engine; the preempted one goes on, and the KV pool ends fully free. The
replica's load reports count the engine's queue by priority."""

from __future__ import annotations

import re
import statistics
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from llmmesh.client import authorized_channel, build_request, internal_channel
from llmmesh.launcher import Stack, StackPorts
from llmmesh.launcher.stack import REPO_MODELS
from llmmesh.v1 import generation_pb2_grpc, inference_pb2, inference_pb2_grpc
from tests.conftest import metric_value, start_service, wait_for
from tests.e2e.test_tenants import write_tenants

FULL = 15  # running sequences the test's engine takes at once


def repository(root: Path) -> Path:
    """The stack's models, the tiny one's engine taking ``FULL`` sequences at a time."""
    repo = root / "models"
    (repo / "llm").mkdir(parents=True)
    (repo / "llm_canary").symlink_to(REPO_MODELS / "llm_canary", target_is_directory=True)
    (repo / "llm" / "1").symlink_to(REPO_MODELS / "llm" / "1", target_is_directory=True)
    config = (REPO_MODELS / "llm" / "config.pbtxt").read_text()
    config = re.sub(r'("max_running" value: \{ string_value: )"\d+"', rf'\1"{FULL}"', config)
    (repo / "llm" / "config.pbtxt").write_text(config)
    return repo


@dataclass(frozen=True)
class Tiers:
    stack: Stack
    router: str
    keys: dict[str, str]

    def engine(self, name: str, **labels: str) -> float:
        url = f"http://{self.stack.address('triton_metrics')}/metrics"
        return metric_value(url, name, {"model": "llm", **labels})


@pytest.fixture(scope="module")
def tiers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Tiers]:
    tmp = tmp_path_factory.mktemp("priority")
    with Stack(tmp / "stack", StackPorts.free(), model_repository=repository(tmp)) as stack:
        keys = write_tenants(
            tmp / "tenants.json",
            {tier: {"id": tier, "tier": tier} for tier in ("critical", "sheddable")},
        )
        port = StackPorts.free().router
        router = start_service(stack, "router", port, tmp, tenants_file=str(tmp / "tenants.json"))
        try:
            yield Tiers(stack, f"127.0.0.1:{port}", keys)
        finally:
            router.terminate(5)


def question(n: int) -> str:
    """A 128-token prompt (the tiny model's tokens are bytes), the head-of-line benchmark's."""
    return f"{n:03d} " + "what would the engine do with a request that cannot wait? " * 3


def first_token_s(address: str, key: str, prompt: str) -> float:
    with authorized_channel(address, key) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        started = time.perf_counter()
        stream = stub.Generate(build_request(prompt, max_tokens=4, ignore_eos=True), timeout=60)
        next(stream)
        took = time.perf_counter() - started
        list(stream)
    return took


def test_a_critical_request_preempts_a_sheddable_generation_in_a_full_engine(
    tiers: Tiers,
) -> None:
    idle = [first_token_s(tiers.router, tiers.keys["critical"], question(n)) for n in range(7)]
    preempted_before = tiers.engine("llm_engine_priority_preemptions_total", priority="2")
    first_word_before = tiers.engine("llm_engine_first_word_steps_total")
    steps_before = tiers.engine("llm_engine_steps_total")
    channel = authorized_channel(tiers.router, tiers.keys["sheddable"])
    stub = generation_pb2_grpc.GenerationStub(channel)
    long = [  # one more than the engine runs: it waits, at its priority
        stub.Generate(build_request(f"long {n}", max_tokens=1000, ignore_eos=True), timeout=120)
        for n in range(FULL + 1)
    ]
    readers = [threading.Thread(target=_drain, args=(s,), daemon=True) for s in long]
    for reader in readers:
        reader.start()
    try:
        wait_for(lambda: tiers.engine("llm_engine_running_sequences") == FULL, 30, "a full engine")
        # The replica's load report counts the queue by priority: a router reads that a
        # critical request would wait behind none of it.
        queue = _reported_queue(tiers.stack)
        assert queue.get("2", 0) >= 1 and queue.get("0", 0) == 0, queue
        loaded = [
            first_token_s(tiers.router, tiers.keys["critical"], question(7 + n)) for n in range(7)
        ]
        preempted = tiers.engine("llm_engine_priority_preemptions_total", priority="2")
        # The steps that left the sheddable work out for a critical first word, counted.
        wait_for(
            lambda: tiers.engine("llm_engine_first_word_steps_total") > first_word_before,
            10,
            "first-word steps counted",
        )
        # Every step is counted: at least one per token of the critical requests' answers.
        assert tiers.engine("llm_engine_steps_total") > steps_before + 7
    finally:
        for stream in long:
            stream.cancel()
        for reader in readers:
            reader.join(30)
        channel.close()
    # A critical request displaced a sheddable one (or took the slot the previous one left
    # before the one it displaced came back).
    assert preempted - preempted_before >= 1
    assert statistics.median(loaded) <= 2 * statistics.median(idle), (idle, loaded)
    wait_for(lambda: tiers.engine("llm_engine_kv_blocks_used") == 0, 30, "the pool free again")


def _reported_queue(stack: Stack) -> dict[str, float]:
    """The engine's queue by priority in the first load report with a sheddable (2) one."""
    with internal_channel(stack.address("inference"), stack.internal_token) as channel:
        stub: Any = inference_pb2_grpc.InferenceStub(channel)
        reports = stub.WatchLoad(inference_pb2.WatchLoadRequest(max_interval_ms=50), timeout=30)
        try:
            for report in reports:
                [llm] = [m for m in report.models if m.model == "llm"]
                queue = {
                    key.rsplit(".", 1)[1]: value
                    for key, value in llm.metrics.items()
                    if key.startswith("waiting_sequences_by_priority.")
                }
                if queue.get("2", 0) >= 1:
                    return queue
        finally:
            reports.cancel()
    raise AssertionError("no load report counted a queued sheddable sequence")


def _drain(stream: grpc.Call) -> None:
    try:
        for _ in stream:  # type: ignore[attr-defined]
            pass
    except grpc.RpcError as err:
        if err.code() != grpc.StatusCode.CANCELLED:
            raise

"""Load reports: parsing the engine's Triton metrics, and the monitor's push semantics."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from services.inference.core import InferenceCore
from services.inference.load import (
    RECENT_SAMPLES,
    LoadMonitor,
    ModelLoad,
    RecentLatency,
    parse_engine_metrics,
)

TRITON_METRICS = """\
# HELP nv_inference_count Number of inferences performed
# TYPE nv_inference_count counter
nv_inference_count{model="llm",version="1"} 12
# HELP llm_engine_running_sequences Sequences being generated
# TYPE llm_engine_running_sequences gauge
llm_engine_running_sequences{model="llm"} 3
llm_engine_running_sequences{model="llm_canary"} 0
# HELP llm_engine_waiting_sequences Sequences queued
# TYPE llm_engine_waiting_sequences gauge
llm_engine_waiting_sequences{model="llm"} 5
# HELP llm_engine_kv_blocks_used KV cache blocks in use
# TYPE llm_engine_kv_blocks_used gauge
llm_engine_kv_blocks_used{model="llm"} 512
# HELP llm_engine_kv_blocks_total KV cache blocks
# TYPE llm_engine_kv_blocks_total gauge
llm_engine_kv_blocks_total{model="llm"} 2048
llm_engine_kv_blocks_total{model="llm_canary"} 2048
# HELP llm_engine_prefix_cache_hit_rate Share of prompt tokens read from the prefix cache
# TYPE llm_engine_prefix_cache_hit_rate gauge
llm_engine_prefix_cache_hit_rate{model="llm"} 0.25
"""


def test_engine_metrics_are_read_per_model() -> None:
    [llm, canary] = parse_engine_metrics(TRITON_METRICS)
    assert (llm.model, llm.running, llm.waiting) == ("llm", 3, 5)
    assert (llm.kv_utilization, llm.prefix_cache_hit_rate) == (0.25, 0.25)
    assert (canary.model, canary.running, canary.kv_utilization) == ("llm_canary", 0, 0.0)


def test_every_engine_gauge_is_reported_so_a_new_signal_needs_no_code_here() -> None:
    page = TRITON_METRICS + (
        "# TYPE llm_engine_spec_decode_acceptance gauge\n"
        'llm_engine_spec_decode_acceptance{model="llm"} 0.7\n'
        "# TYPE llm_engine_prompt_tokens_total counter\n"
        'llm_engine_prompt_tokens_total{model="llm"} 900\n'
    )
    [llm, _] = parse_engine_metrics(page)
    assert llm.metrics["spec_decode_acceptance"] == 0.7
    assert llm.metrics["running_sequences"] == 3 and "prompt_tokens_total" not in llm.metrics


def test_a_gauge_by_priority_is_reported_per_priority() -> None:
    """The engine's queue by scheduling priority (as Triton prints the labels: model, then
    priority) is a metric per priority; the queue's total stays the unlabelled gauge's."""
    page = TRITON_METRICS + (
        "# TYPE llm_engine_waiting_sequences_by_priority gauge\n"
        'llm_engine_waiting_sequences_by_priority{model="llm",priority="0"} 1\n'
        'llm_engine_waiting_sequences_by_priority{model="llm",priority="2"} 4\n'
    )
    [llm, _] = parse_engine_metrics(page)
    assert llm.waiting == 5
    assert llm.metrics["waiting_sequences_by_priority.0"] == 1
    assert llm.metrics["waiting_sequences_by_priority.2"] == 4
    assert llm.metrics["waiting_sequences"] == 5


def test_recent_latency_medians() -> None:
    latency = RecentLatency()
    for ttft, tpot in ((0.01, 0.001), (0.03, None), (0.02, 0.003)):
        latency.add(ttft, tpot)
    assert latency.medians() == (0.02, 0.002)
    assert RecentLatency().medians() == (0.0, 0.0)


def test_recent_latency_keeps_the_newest_samples_only() -> None:
    latency = RecentLatency()
    for _ in range(RECENT_SAMPLES):
        latency.add(0.5, 0.5)
    for _ in range(RECENT_SAMPLES // 2 + 1):
        latency.add(0.01, None)  # newer, and faster: now the median
    assert latency.medians() == (0.01, 0.5)


def test_monitor_pushes_changes_and_reports_an_unreachable_engine() -> None:
    texts: list[str | OSError] = [
        TRITON_METRICS,
        TRITON_METRICS.replace("} 3", "} 4"),
        OSError("refused"),
    ]

    async def read() -> str:
        item = texts[0] if len(texts) == 1 else texts.pop(0)
        if isinstance(item, OSError):
            raise item
        return item

    async def scenario() -> list[tuple[int, bool]]:
        monitor = LoadMonitor(read, lambda: 2, RecentLatency(), poll_interval_s=0.001)
        seen: list[tuple[int, bool]] = []
        async for snapshot in monitor.watch(max_interval_s=5.0):
            running = snapshot.models[0].running if snapshot.models else -1
            seen.append((running, snapshot.engine_reachable))
            if not snapshot.engine_reachable:
                break
        await monitor.close()
        return seen

    seen = asyncio.run(asyncio.wait_for(scenario(), 10))
    assert seen[0] == (3, True)
    assert (4, True) in seen
    assert seen[-1] == (-1, False)


RUNNING, WAITING = "llm_engine_running_sequences", "llm_engine_waiting_sequences"
IDLE_METRICS = TRITON_METRICS.replace(f'{RUNNING}{{model="llm"}} 3', f'{RUNNING}{{model="llm"}} 0')
IDLE_METRICS = IDLE_METRICS.replace(f'{WAITING}{{model="llm"}} 5', f'{WAITING}{{model="llm"}} 0')


class CountedReads:
    """An engine's metrics page that notes when it is read; ``reached(n)`` resolves once
    it has been read n times."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.at: list[float] = []
        self._waits: dict[int, asyncio.Future[None]] = {}

    async def __call__(self) -> str:
        self.at.append(time.monotonic())
        waiting = self._waits.get(len(self.at))
        if waiting is not None and not waiting.done():
            waiting.set_result(None)
        return self.text

    def reached(self, reads: int) -> Awaitable[None]:
        waiting = self._waits.get(reads)
        if waiting is None:
            waiting = self._waits[reads] = asyncio.get_running_loop().create_future()
            if len(self.at) >= reads:  # already read that often: resolved at once
                waiting.set_result(None)
        return waiting


def watched(
    reads: CountedReads, in_flight: int, idle_s: float, then: Callable[[LoadMonitor], None]
) -> list[float]:
    """Watches a monitor over ``reads`` until it has read the engine twice, calls ``then``,
    and waits (10 s at most) for a third read: when each read was made."""

    async def scenario() -> list[float]:
        monitor = LoadMonitor(
            reads, lambda: in_flight, RecentLatency(), poll_interval_s=0.001,
            idle_poll_interval_s=idle_s,
        )  # fmt: skip
        watch = monitor.watch(max_interval_s=60.0)
        await anext(watch)  # the watch's own read; the poller's follows
        await asyncio.wait_for(reads.reached(2), 10)
        then(monitor)
        await asyncio.wait_for(reads.reached(3), 10)
        await watch.aclose()
        await monitor.close()
        return reads.at

    return asyncio.run(scenario())


def test_an_idle_engine_is_read_once_per_idle_interval() -> None:
    at = watched(CountedReads(IDLE_METRICS), in_flight=0, idle_s=0.2, then=lambda _: None)
    assert at[2] - at[1] >= 0.19  # read every 1 ms, as when busy, it would be far sooner


def test_a_generation_starting_has_an_idle_engine_read_within_a_polling_period() -> None:
    start = LoadMonitor.generation_started
    at = watched(CountedReads(IDLE_METRICS), in_flight=0, idle_s=60.0, then=start)
    assert at[2] - at[1] < 10  # not the idle interval's 60 s


def test_a_busy_engine_or_generations_here_are_read_every_poll_interval() -> None:
    for metrics, in_flight in ((TRITON_METRICS, 0), (IDLE_METRICS, 1)):
        at = watched(CountedReads(metrics), in_flight, idle_s=60.0, then=lambda _: None)
        assert at[2] - at[1] < 10


def test_load_reports_use_the_mesh_model_names_of_aliased_models() -> None:
    core = InferenceCore(backend=None, max_tokens_limit=8, model_aliases={"llm": "llm_canary"})  # type: ignore[arg-type]
    engine = [ModelLoad("llm", running=1), ModelLoad("llm_canary", running=2), ModelLoad("x")]
    assert core.mesh_view(engine) == (ModelLoad("llm", running=2), ModelLoad("x"))

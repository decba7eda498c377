"""One Triton replica's client side, built once from its config: the Triton client, the
inference core over it, its models' health and its load. The inference service serves it
over gRPC; a router serves it in process for an endpoint that is a Triton server itself
(services/router/triton_link.py)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from services.inference.config import InferenceConfig
from services.inference.core import GenerationBackend, InferenceCore
from services.inference.faults import FaultyBackend
from services.inference.health import HealthKeeper, ModelHealth
from services.inference.load import LoadMonitor
from services.inference.metrics_page import MetricsPage
from services.inference.triton import StreamGap, TritonBackend

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Replica:
    backend: TritonBackend
    core: InferenceCore
    keeper: HealthKeeper
    monitor: LoadMonitor
    metrics_page: MetricsPage

    def start(self) -> None:
        """Starts watching the models' health (in the running loop)."""
        self.keeper.start()

    async def close(self) -> None:
        await self.keeper.close()
        await self.monitor.close()
        await self.metrics_page.close()
        await self.backend.close()


def triton_backend(config: InferenceConfig) -> TritonBackend:
    """This replica's Triton client, asking the engine for the configured stream gap."""
    gap = StreamGap(config.engine_stream_gap_ms / 1000, config.engine_stream_gap_after)
    return TritonBackend(config.triton_url, config.stream_timeout_s, gap=gap)


def build_replica(config: InferenceConfig) -> Replica:
    backend = triton_backend(config)
    health = ModelHealth(config.stall_timeout_s)
    served_models = set(config.model_aliases.values()) or set(config.models)
    keeper = HealthKeeper(
        health, backend, lambda: served_models, config.probe_interval_s, config.quiet_probe_s
    )
    generating: GenerationBackend = backend
    if config.faults.active:
        log.warning("this replica injects faults", extra={"fields": config.faults.model_dump()})
        generating = FaultyBackend(backend, config.faults)
    core = InferenceCore(
        generating, config.max_tokens_limit, config.model_aliases, health, keeper.failed
    )
    metrics_page = MetricsPage(config.triton_metrics_url)
    monitor = LoadMonitor(
        metrics_page.read,
        lambda: core.in_flight,
        core.latency,
        config.load_poll_interval_s,
        config.load_idle_poll_interval_s,
    )
    return Replica(backend, core, keeper, monitor, metrics_page)

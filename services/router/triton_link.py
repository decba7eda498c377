"""An endpoint that is a Triton server itself, served in the router's process.

The inference service's own core (services/inference/replica.py) runs here instead of
behind a gRPC hop: the router streams from Triton with tritonclient, reads the engine's
load from Triton's metrics page and watches its models' health, as the inference service
would. One Python process and two messages less per response on the way: what a
generation costs the mesh is mostly its messages ("What a message costs",
docs/benchmarks.md). The inference service stays the way to reach a Triton behind a
sidecar or on another host the router should not call directly.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from dataclasses import replace

from llmmesh.types import Chunk, InferenceCall, ModelCard
from services.inference.config import InferenceConfig
from services.inference.replica import build_replica
from services.router.connector import LoadReport, load_metrics
from services.router.endpoints import Endpoint


class TritonLink:
    """``endpoint.address`` is Triton's gRPC address, ``endpoint.triton_metrics_url`` its
    metrics page; ``endpoint.models``, if named, are probed while idle. Everything else is
    the inference service's defaults. Built in the running loop."""

    def __init__(self, endpoint: Endpoint) -> None:
        config = InferenceConfig(
            triton_url=endpoint.address,
            triton_metrics_url=endpoint.triton_metrics_url,
            models=list(endpoint.models),
        )
        self._replica = build_replica(config)
        self._replica.start()

    def generate(self, call: InferenceCall) -> AsyncGenerator[Chunk, None]:
        # The core's own generator, not one wrapped around it: a layer less per chunk.
        self._replica.monitor.generation_started()
        return self._replica.core.generate(call)

    async def watch_load(self, max_interval_s: float) -> AsyncGenerator[LoadReport, None]:
        core = self._replica.core
        async for snapshot in self._replica.monitor.watch(max_interval_s):
            named = replace(snapshot, models=core.mesh_view(snapshot.models))
            yield LoadReport(
                {m.model: load_metrics(m) for m in named.models},
                named.engine_reachable,
                frozenset(m.model for m in named.models if m.failed),
            )

    async def describe(self, model: str) -> ModelCard:
        return await self._replica.core.describe(model)

    async def close(self, grace_s: float | None = None) -> None:
        await self._replica.close()

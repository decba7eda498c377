"""The inference replicas behind the router: one client each, their load, and picking.

Each replica's load reports (``Inference.WatchLoad``) are followed for as long as the
router runs; a replica that stops reporting is judged by the router's own in-flight count
until it reports again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections import Counter
from collections.abc import AsyncGenerator, Sequence
from typing import Any

import grpc
from prometheus_client import Counter as PromCounter
from prometheus_client import Gauge

from llmmesh.types import Chunk, InferenceCall
from llmmesh.v1 import inference_pb2, inference_pb2_grpc
from services.router.picking import Picker, ReportedLoad, views
from services.router.upstreams import CHANNEL_OPTIONS, GrpcInferenceClient

log = logging.getLogger(__name__)

PICKS = PromCounter("llm_router_picks_total", "Requests sent, by replica", ["endpoint"])
IN_FLIGHT = Gauge("llm_router_endpoint_in_flight", "Streams in flight, by replica", ["endpoint"])

RECONNECT_BACKOFF_S = (0.1, 2.0)


class InferencePool:
    def __init__(
        self,
        addresses: Sequence[str],
        picker: Picker,
        report_interval_s: float = 0.05,
        stale_after_s: float = 1.0,
    ) -> None:
        self._addresses = list(addresses)
        self._picker = picker
        self._interval_ms = int(report_interval_s * 1000)
        self._stale_after = stale_after_s
        self._channels = {
            a: grpc.aio.insecure_channel(a, options=CHANNEL_OPTIONS) for a in self._addresses
        }
        self._clients = {a: GrpcInferenceClient(ch, a) for a, ch in self._channels.items()}
        self._in_flight: Counter[str] = Counter()
        self._reports: dict[tuple[str, str], ReportedLoad] = {}
        self._watchers: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        if len(self._addresses) > 1:  # with one replica there is nothing to choose
            self._watchers = [asyncio.create_task(self._follow(a)) for a in self._addresses]

    async def close(self) -> None:
        for task in self._watchers:
            task.cancel()
        await asyncio.gather(*self._watchers, return_exceptions=True)
        for channel in self._channels.values():
            await channel.close()

    def pick(self, model: str) -> str:
        reports = {a: r for (a, m), r in self._reports.items() if m == model}
        return self._picker.pick(
            views(self._addresses, self._in_flight, reports, self._stale_after)
        )

    async def generate(self, call: InferenceCall) -> AsyncGenerator[Chunk, None]:
        address = self.pick(call.model)
        PICKS.labels(address).inc()
        self._in_flight[address] += 1
        IN_FLIGHT.labels(address).set(self._in_flight[address])
        stream = self._clients[address].generate(call)
        try:
            async for chunk in stream:
                yield chunk
        finally:
            await stream.aclose()  # a generation cut short is cancelled at the replica now
            self._in_flight[address] -= 1
            IN_FLIGHT.labels(address).set(self._in_flight[address])

    async def _follow(self, address: str) -> None:
        """Keeps the replica's latest per-model load, reconnecting when the stream breaks."""
        stub: Any = inference_pb2_grpc.InferenceStub(self._channels[address])
        request = inference_pb2.WatchLoadRequest(max_interval_ms=self._interval_ms)
        while True:
            with contextlib.suppress(grpc.aio.AioRpcError):
                async for report in stub.WatchLoad(request):
                    for load in report.models:
                        self._reports[(address, load.model)] = ReportedLoad(
                            running=load.running,
                            waiting=load.waiting,
                            kv_utilization=load.kv_utilization,
                        )
            # Reconnect pacing for a replica that is down or restarting.
            await asyncio.sleep(random.uniform(*RECONNECT_BACKOFF_S))

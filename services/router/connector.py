"""How the router reaches one inference replica: the transport seam under the replica set.

A ``Connector`` opens a ``ReplicaLink`` per discovered endpoint; the link streams
generations and load reports. ``GrpcConnector`` speaks the mesh's Inference API over
grpc.aio (directly, or through the local sidecar, which forwards each call to the
endpoint named in ``x-gateway-destination-endpoint``); tests use an in-memory one.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, Mapping
from dataclasses import dataclass, field
from typing import Protocol

import grpc

from llmmesh.runtime.grpc_status import from_rpc_error
from llmmesh.runtime.metadata import DESTINATION_ENDPOINT
from llmmesh.types import Chunk, InferenceCall, ModelCard
from llmmesh.v1 import inference_pb2, inference_pb2_grpc
from services.router.endpoints import Endpoint
from services.router.multiplex import GenerationMux
from services.router.upstreams import CHANNEL_OPTIONS, Metadata, ReplicaClient

log = logging.getLogger(__name__)

DESCRIBE_TIMEOUT_S = 30.0  # a card is a few MB (the tokenizer), asked once per model


@dataclass(frozen=True)
class LoadReport:
    """One load report of a replica: each model's engine load (metric name -> value),
    and whether its engine could be read at all."""

    models: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    engine_reachable: bool = True
    # Models whose instance stopped answering there (a stall, a dead backend process):
    # not to be picked for them until a report no longer names them.
    failed_models: frozenset[str] = frozenset()


class ReplicaLink(Protocol):
    def generate(self, call: InferenceCall) -> AsyncGenerator[Chunk, None]:
        """Chunks with per-chunk token counts; closing it early cancels the generation.
        Raises Unavailable (the replica failed) or the replica's own refusal."""
        ...

    def watch_load(self, max_interval_s: float) -> AsyncGenerator[LoadReport, None]:
        """Reports on every change, at least every ``max_interval_s``; ends (or raises
        Unavailable) when the stream breaks; closing it ends the stream."""
        ...

    async def describe(self, model: str) -> ModelCard:
        """The model's card (its tokenizer, chat template, context), as the replica's
        model reports it; NotFound if the replica does not serve it."""
        ...

    async def close(self, grace_s: float | None = None) -> None: ...


class Connector(Protocol):
    def connect(self, endpoint: Endpoint) -> ReplicaLink: ...


class ModelLoadFields(Protocol):
    """A model's load in a report: the message's, or the inference core's own."""

    @property
    def metrics(self) -> Mapping[str, float]: ...
    @property
    def running(self) -> int: ...
    @property
    def waiting(self) -> int: ...
    @property
    def kv_utilization(self) -> float: ...
    @property
    def prefix_cache_hit_rate(self) -> float: ...


def load_metrics(model: ModelLoadFields) -> dict[str, float]:
    """A model's load as scheduling reads it: every metric the engine reports, and the
    report's named fields."""
    return {
        **model.metrics,
        "running": model.running,
        "waiting": model.waiting,
        "kv_utilization": model.kv_utilization,
        "prefix_cache_hit_rate": model.prefix_cache_hit_rate,
    }


class GrpcLink:
    """One replica over one grpc.aio channel."""

    def __init__(
        self, endpoint: Endpoint, via: str, auth: Metadata = (), multiplex: bool = True
    ) -> None:
        self._channel = grpc.aio.insecure_channel(via or endpoint.address, options=CHANNEL_OPTIONS)
        destination = ((DESTINATION_ENDPOINT, endpoint.address),) if via else ()
        self._metadata = auth + destination
        self._client: ReplicaClient | GenerationMux = (
            GenerationMux(self._channel, endpoint.address, self._metadata)
            if multiplex
            else ReplicaClient(self._channel, endpoint.address, self._metadata)
        )
        self._stub = inference_pb2_grpc.InferenceStub(self._channel)
        self._address = endpoint.address

    def generate(self, call: InferenceCall) -> AsyncGenerator[Chunk, None]:
        return self._client.generate(call)

    async def watch_load(self, max_interval_s: float) -> AsyncGenerator[LoadReport, None]:
        request = inference_pb2.WatchLoadRequest(max_interval_ms=int(max_interval_s * 1000))
        try:
            async for report in self._stub.WatchLoad(request, metadata=self._metadata):
                models = {m.model: load_metrics(m) for m in report.models}
                failed = frozenset(m.model for m in report.models if m.failed)
                yield LoadReport(models, report.engine_reachable, failed)
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc, "inference replica", self._address) from None

    async def describe(self, model: str) -> ModelCard:
        request = inference_pb2.DescribeModelRequest(model=model)
        try:
            card = await self._stub.DescribeModel(
                request, metadata=self._metadata, timeout=DESCRIBE_TIMEOUT_S
            )
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc, "inference replica", self._address) from None
        return ModelCard(
            card.model,
            card.max_context,
            card.tokenizer_json,
            card.chat_template,
            card.bos_token,
            card.eos_token,
            card.add_bos,
        )

    async def close(self, grace_s: float | None = None) -> None:
        if isinstance(self._client, GenerationMux):
            await self._client.close()
        await self._channel.close(grace_s)


@dataclass(frozen=True)
class GrpcConnector:
    """Replicas dialed directly, or through ``via``: the local sidecar's listener; every
    call presents ``auth``, the mesh's credential. ``multiplex``: generations share one
    long-lived stream per replica (Inference.Multiplex) instead of a call each. An
    endpoint that is a Triton server itself (``triton_metrics_url``) is served in this
    process instead (services/router/triton_link.py)."""

    via: str = ""
    auth: Metadata = ()
    multiplex: bool = True

    def connect(self, endpoint: Endpoint) -> ReplicaLink:
        if endpoint.triton_metrics_url:
            from services.router.triton_link import TritonLink  # it builds on this module

            if self.via:  # Triton speaks no mTLS: said once per endpoint, not hidden
                log.warning(
                    "a Triton endpoint is dialed directly, not through the sidecar",
                    extra={"fields": {"endpoint": endpoint.address, "via": self.via}},
                )
            return TritonLink(endpoint)
        return GrpcLink(endpoint, self.via, self.auth, self.multiplex)

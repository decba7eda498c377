"""An in-memory stand-in for inference replicas, under the router's connector seam
(services/router/connector.py), for unit tests of the replica set and the dispatcher.

Each replica "continues" one fixed text: the token after a prompt of n characters is the
text's character n (so a stream resumed elsewhere with the text already sent as prompt
goes on where it broke). A test scripts how a replica fails: before its first chunk,
after some chunks, or by refusing the request. It never ships in the product.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field

from llmmesh.runtime.errors import MeshError, Unavailable
from llmmesh.types import Chunk, FinishReason, InferenceCall, ModelCard
from services.router.connector import LoadReport
from services.router.endpoints import Endpoint

TEXT = "Once upon a time there was a mesh that served every tenant its tokens in order. " * 8


@dataclass(frozen=True)
class Hang:
    after: int  # chunks sent before the replica goes silent


@dataclass
class MemoryReplica:
    """One replica: what it was asked, and how it fails the next generations."""

    address: str
    calls: list[InferenceCall] = field(default_factory=list)
    # Per upcoming generation, in order: None (serve it whole), an int (break with
    # UNAVAILABLE after that many chunks; 0: before the first), Hang (go silent after
    # that many chunks, as behind a partition), or an error to refuse with.
    script: list[int | Hang | MeshError | None] = field(default_factory=list)
    reports: asyncio.Queue[LoadReport] = field(default_factory=asyncio.Queue)
    closed: bool = False
    card_error: MeshError | None = None  # set: describe() fails with it
    watches: int = 0  # load report streams opened so far
    watch_errors: list[Exception] = field(default_factory=list)  # raised by the next ones

    def fail_next(self, *plan: int | Hang | MeshError | None) -> None:
        self.script.extend(plan)

    async def generate(self, call: InferenceCall) -> AsyncGenerator[Chunk, None]:
        self.calls.append(call)
        plan = self.script.pop(0) if self.script else None
        if isinstance(plan, MeshError):
            raise plan
        start = len(call.prompt)
        for i in range(call.sampling.max_tokens):
            if isinstance(plan, Hang) and i == plan.after:
                await asyncio.Event().wait()  # silent for good
            if isinstance(plan, int) and i == plan:
                raise Unavailable(f"inference replica {self.address} went away")
            last = i == call.sampling.max_tokens - 1
            yield Chunk(TEXT[start + i], 1, FinishReason.LENGTH if last else None)

    async def watch_load(self, max_interval_s: float) -> AsyncGenerator[LoadReport, None]:
        self.watches += 1
        if self.watch_errors:
            raise self.watch_errors.pop(0)
        while True:
            yield await self.reports.get()

    async def describe(self, model: str) -> ModelCard:
        if self.card_error is not None:
            raise self.card_error
        return ModelCard(model, max_context=2048)  # byte-level, the mesh's layout

    async def close(self, grace_s: float | None = None) -> None:
        self.closed = True


@dataclass
class MemoryConnector:
    replicas: dict[str, MemoryReplica] = field(default_factory=dict)

    def connect(self, endpoint: Endpoint) -> MemoryReplica:
        return self.replicas.setdefault(endpoint.address, MemoryReplica(endpoint.address))


def expected_text(prompt: str, max_tokens: int) -> str:
    """What a whole generation of ``prompt`` reads, however often it moved."""
    return TEXT[len(prompt) : len(prompt) + max_tokens]

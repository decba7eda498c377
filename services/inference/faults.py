"""Faults a replica injects into its own generations, for drills and for tests of what
watches replicas (a canary's gates, the router's breakers): a delay before the first
chunk, and a share of generations refused as if the engine were unavailable. Off unless
configured (``faults`` in the inference service's settings)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator

from pydantic import BaseModel, Field

from llmmesh.runtime.errors import Unavailable
from llmmesh.types import Chunk, InferenceCall, ModelCard
from services.inference.core import GenerationBackend


class FaultSettings(BaseModel):
    first_token_delay_s: float = Field(default=0.0, ge=0)
    error_rate: float = Field(default=0.0, ge=0, le=1)

    @property
    def active(self) -> bool:
        return self.first_token_delay_s > 0 or self.error_rate > 0


class FaultyBackend:
    def __init__(
        self, backend: GenerationBackend, faults: FaultSettings, rng: random.Random | None = None
    ) -> None:
        self._backend = backend
        self._faults = faults
        self._rng = rng or random.Random()

    async def generate(self, call: InferenceCall) -> AsyncIterator[Chunk]:
        if self._rng.random() < self._faults.error_rate:
            raise Unavailable("the engine is unavailable (an injected fault)")
        first = True
        async for chunk in self._backend.generate(call):
            if first and self._faults.first_token_delay_s:
                await asyncio.sleep(self._faults.first_token_delay_s)  # the injected latency
            first = False
            yield chunk

    async def describe(self, model: str) -> ModelCard:
        return await self._backend.describe(model)

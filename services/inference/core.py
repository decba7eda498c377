"""Inference core: validates a call, streams it from the backend, counts what it served."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import replace
from typing import Protocol

from prometheus_client import Counter, Gauge

from llmmesh.runtime.errors import InvalidArgument
from llmmesh.runtime.metrics import TPOT, TTFT
from llmmesh.types import Chunk, InferenceCall, check_sampling
from services.inference.load import ModelLoad, RecentLatency

OUTPUT_TOKENS = Counter("llm_inference_output_tokens_total", "Tokens streamed", ["model"])
REQUESTS = Counter("llm_inference_requests_total", "Requests finished", ["model", "outcome"])
IN_FLIGHT = Gauge("llm_inference_in_flight_requests", "Generations streaming now")


class GenerationBackend(Protocol):
    def generate(self, call: InferenceCall) -> AsyncIterator[Chunk]: ...


class InferenceCore:
    def __init__(
        self,
        backend: GenerationBackend,
        max_tokens_limit: int,
        model_aliases: Mapping[str, str] | None = None,
    ) -> None:
        self._backend = backend
        self._limit = max_tokens_limit
        self._aliases = dict(model_aliases or {})
        self.in_flight = 0
        self.latency = RecentLatency()

    async def generate(self, call: InferenceCall) -> AsyncIterator[Chunk]:
        if not call.model:
            raise InvalidArgument("model", "required")
        if not call.prompt:
            raise InvalidArgument("prompt", "must not be empty")
        check_sampling(call.sampling, self._limit)
        started, first_at, tokens, outcome = time.perf_counter(), 0.0, 0, "error"
        self.in_flight += 1
        IN_FLIGHT.inc()
        try:
            served = replace(call, model=self._aliases.get(call.model, call.model))
            async for chunk in self._backend.generate(served):
                if not first_at and chunk.text:
                    first_at = time.perf_counter()
                tokens += chunk.num_tokens
                yield chunk
                if chunk.finish_reason is not None:
                    outcome = chunk.finish_reason.value
        except GeneratorExit:
            outcome = "cancelled"
            raise
        finally:
            self.in_flight -= 1
            IN_FLIGHT.dec()
            self._record(call.model, outcome, tokens, started, first_at)

    def mesh_view(self, models: Sequence[ModelLoad]) -> tuple[ModelLoad, ...]:
        """Engine load under the names the mesh uses: an aliased Triton model reports as
        its alias, and a Triton model an alias shadows is left out."""
        names = {triton: mesh for mesh, triton in self._aliases.items()}
        return tuple(
            replace(m, model=names[m.model]) if m.model in names else m
            for m in models
            if m.model in names or m.model not in self._aliases
        )

    def _record(self, model: str, outcome: str, tokens: int, started: float, first: float) -> None:
        REQUESTS.labels(model, outcome).inc()
        OUTPUT_TOKENS.labels(model).inc(tokens)
        ttft = first - started if first else None
        tpot = (time.perf_counter() - first) / (tokens - 1) if first and tokens > 1 else None
        if ttft is not None:
            TTFT.labels(model, "").observe(ttft)
        if tpot is not None:
            TPOT.labels(model, "").observe(tpot)
        self.latency.add(ttft, tpot)

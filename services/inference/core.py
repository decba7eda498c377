"""Inference core: validates a call, streams it from the backend, counts what it served."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping, Sequence
from dataclasses import replace
from typing import Protocol

from prometheus_client import Counter, Gauge

from llmmesh.runtime.errors import InvalidArgument
from llmmesh.runtime.metrics import TPOT, TTFT
from llmmesh.structures import CachePartition, compile_structure
from llmmesh.types import Chunk, InferenceCall, ModelCard, check_sampling
from services.inference.health import ModelHealth
from services.inference.load import ModelLoad, RecentLatency
from services.inference.triton import ModelInstanceFailed

OUTPUT_TOKENS = Counter("llm_inference_output_tokens_total", "Tokens streamed", ["model"])
REQUESTS = Counter("llm_inference_requests_total", "Requests finished", ["model", "outcome"])
IN_FLIGHT = Gauge("llm_inference_in_flight_requests", "Generations streaming now")


class GenerationBackend(Protocol):
    def generate(self, call: InferenceCall) -> AsyncIterator[Chunk]: ...

    async def describe(self, model: str) -> ModelCard: ...


class InferenceCore:
    """``health`` follows whether each model answers (services/inference/health.py);
    ``on_failure(model, cause)`` hears of a model whose instance is gone."""

    def __init__(
        self,
        backend: GenerationBackend,
        max_tokens_limit: int,
        model_aliases: Mapping[str, str] | None = None,
        health: ModelHealth | None = None,
        on_failure: Callable[[str, str], None] | None = None,
    ) -> None:
        self._backend = backend
        self._limit = max_tokens_limit
        self._aliases = dict(model_aliases or {})
        self.health = health or ModelHealth(stall_s=60.0)
        self._on_failure = on_failure or self.health.fail
        self.in_flight = 0
        self.latency = RecentLatency()

    async def generate(self, call: InferenceCall) -> AsyncGenerator[Chunk, None]:
        if not call.model:
            raise InvalidArgument("model", "required")
        if not call.prompt:
            raise InvalidArgument("prompt", "must not be empty")
        if any(token < 0 for token in call.prompt_ids):
            raise InvalidArgument("prompt_token_ids", "token ids are >= 0")
        if call.priority is not None and call.priority < 0:
            raise InvalidArgument("priority", f"must be >= 0 (lower: sooner), got {call.priority}")
        if not 0 <= call.resumed_output_chars <= len(call.prompt):
            raise InvalidArgument(
                "resumed_output_chars",
                f"must be in [0, the prompt's length {len(call.prompt)}], "
                f"got {call.resumed_output_chars}",
            )
        # Each prefix-cache partition keeps its own checked structures, as at the router.
        partition = CachePartition(group=call.cache_salt)
        if call.sampling.structured is not None:
            await compile_structure(call.sampling.structured, partition)
        check_sampling(call.sampling, self._limit, partition)
        alias = self._aliases.get(call.model)
        served = call if alias is None else replace(call, model=alias)
        self.health.check(served.model)
        started, first_at, tokens, outcome = time.perf_counter(), 0.0, 0, "error"
        self.in_flight += 1
        IN_FLIGHT.inc()
        try:
            async with self.health.watching(served.model) as answered:
                async for chunk in self._backend.generate(served):
                    answered()
                    if not first_at and chunk.text:
                        first_at = time.perf_counter()
                    tokens += chunk.num_tokens
                    yield chunk
                    if chunk.finish_reason is not None:
                        outcome = chunk.finish_reason.value
        except ModelInstanceFailed:
            self._on_failure(served.model, "backend process")
            raise
        except GeneratorExit:
            outcome = "cancelled"
            raise
        finally:
            self.in_flight -= 1
            IN_FLIGHT.dec()
            self._record(call.model, outcome, tokens, started, first_at)

    async def describe(self, model: str) -> ModelCard:
        """The card of the Triton model behind the mesh's ``model``, asked of the model
        itself (a reload may bring another version), under the mesh's name."""
        if not model:
            raise InvalidArgument("model", "required")
        served = self._aliases.get(model, model)
        self.health.check(served)
        return replace(await self._backend.describe(served), model=model)

    def mesh_view(self, models: Sequence[ModelLoad]) -> tuple[ModelLoad, ...]:
        """Engine load under the names the mesh uses: an aliased Triton model reports as
        its alias, and a Triton model an alias shadows is left out; each says whether it
        is failed here."""
        names = {triton: mesh for mesh, triton in self._aliases.items()}
        failed = self.health.failed
        shown = [
            replace(m, model=names.get(m.model, m.model), failed=m.model in failed)
            for m in models
            if m.model in names or m.model not in self._aliases
        ]
        # A failed model whose engine no longer reports is still named, as failed.
        missing = set(failed) - {m.model for m in models}
        shown += [ModelLoad(names.get(m, m), failed=True) for m in sorted(missing)]
        return tuple(shown)

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

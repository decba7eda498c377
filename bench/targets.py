"""What a benchmark sends requests to: the router (public gRPC API or its OpenAI-compatible
HTTP API) or Triton directly."""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import AsyncIterable, Iterable
from pathlib import Path
from typing import Protocol, TypeVar

import aiohttp
import grpc

from bench.metrics import RequestRecord
from bench.workload import BenchRequest
from llmmesh.client import auth_metadata, build_request
from llmmesh.stream_client import GenerationStream
from llmmesh.types import InferenceCall, Sampling
from llmmesh.v1 import generation_pb2, generation_pb2_grpc
from services.inference.triton import TritonBackend
from services.inference.warm_streams import MAX_IDLE_STREAMS
from services.router.tenants import hash_key

# Router settings that turn admission control off: a window too wide to matter, which
# cannot adapt (every request goes straight on to a replica).
NO_ADMISSION_CONTROL = {
    f"admission__{bound}_limit": "100000" for bound in ("initial", "min", "max")
}


def write_tenants(path: Path, tiers: Iterable[str]) -> dict[str, str]:
    """A router tenants file with one tenant per tier (``<tier>-tenant``, no budgets);
    returns each tier's fresh API key."""
    keys = {tier: secrets.token_urlsafe(16) for tier in tiers}
    tenants = [
        {"id": f"{tier}-tenant", "tier": tier, "api_key_hashes": [hash_key(key)]}
        for tier, key in keys.items()
    ]
    path.write_text(json.dumps({"tenants": tenants}))
    return keys


class Target(Protocol):
    name: str

    async def send(self, request: BenchRequest, record: RequestRecord) -> None:
        """Streams one request, filling ``record``; raises on failure."""

    async def close(self) -> None: ...


T = TypeVar("T", "RouterTarget", "RouterStreamTarget", "OpenAiTarget", "TritonTarget")


def named(target: T, name: str) -> T:
    """The target under another name (several routers in one run)."""
    target.name = name
    return target


class RouterTarget:
    name = "router"

    def __init__(
        self, address: str, model: str, api_key: str = "", timeout_s: float | None = None
    ) -> None:
        self._channel = grpc.aio.insecure_channel(address)
        self._stub = generation_pb2_grpc.GenerationStub(self._channel)
        self._model = model
        self._metadata = auth_metadata(api_key)
        self._timeout = timeout_s

    async def send(self, request: BenchRequest, record: RequestRecord) -> None:
        message = _public_request(request, self._model)
        call = self._stub.Generate(message, metadata=self._metadata, timeout=self._timeout)
        await _record_replies(call, record)

    async def close(self) -> None:
        await self._channel.close()


def _public_request(request: BenchRequest, model: str) -> generation_pb2.GenerateRequest:
    return build_request(
        request.prompt,
        model=model,
        max_tokens=request.max_tokens,
        ignore_eos=True,
        session_id=request.session_id,
    )


async def _record_replies(
    replies: AsyncIterable[generation_pb2.GenerateResponse], record: RequestRecord
) -> None:
    """One generation's public responses, as the client sees them arrive."""
    async for reply in replies:
        now = time.perf_counter()
        if reply.text:
            record.first_token_at = record.first_token_at or now
            record.chunk_times.append(now)
        if reply.finish_reason:
            record.output_tokens = reply.usage.completion_tokens
    record.finished_at = time.perf_counter()


class RouterStreamTarget:
    """The router's public API as a client with many requests sends them: every request a
    generation on one GenerateStream call kept open (as Triton's clients keep a stream)."""

    name = "router-stream"

    def __init__(self, address: str, model: str, api_key: str = "") -> None:
        self._channel = grpc.aio.insecure_channel(address)
        self._stream = GenerationStream(self._channel, auth_metadata(api_key))
        self._model = model

    async def send(self, request: BenchRequest, record: RequestRecord) -> None:
        await _record_replies(self._stream.generate(_public_request(request, self._model)), record)

    async def close(self) -> None:
        await self._stream.close()
        await self._channel.close()


class OpenAiTarget:
    """The router's OpenAI-compatible HTTP API (/v1/completions, server-sent events), as
    an OpenAI client sends it."""

    name = "openai"

    def __init__(self, base_url: str, model: str, api_key: str = "") -> None:
        self._url = base_url.rstrip("/") + "/completions"
        self._model = model
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._session: aiohttp.ClientSession | None = None

    async def send(self, request: BenchRequest, record: RequestRecord) -> None:
        if self._session is None:
            connector = aiohttp.TCPConnector(limit=0)  # one connection per stream, as clients do
            self._session = aiohttp.ClientSession(connector=connector)
        body = {
            "model": self._model or "llm",
            "prompt": request.prompt,
            "max_tokens": request.max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": True,
        }
        headers = dict(self._headers)
        if request.session_id:
            headers["x-session-id"] = request.session_id
        async with self._session.post(self._url, json=body, headers=headers) as response:
            if response.status != 200:
                raise RuntimeError(f"HTTP {response.status}: {await response.text()}")
            async for line in response.content:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                event = json.loads(line[6:])
                now = time.perf_counter()
                if event["choices"] and event["choices"][0]["text"]:
                    record.first_token_at = record.first_token_at or now
                    record.chunk_times.append(now)
                if event.get("usage"):
                    record.output_tokens = event["usage"]["completion_tokens"]
        record.finished_at = time.perf_counter()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


class TritonTarget:
    """Triton's gRPC endpoint with the vLLM backend contract, as any Triton client sends it."""

    name = "triton"

    def __init__(self, url: str, model: str, keep_streams: bool = True) -> None:
        """``keep_streams``: a stream serves one request after another, as tritonclient's
        stream API is used; False: a stream of its own per request."""
        idle = MAX_IDLE_STREAMS if keep_streams else 0
        self._backend = TritonBackend(url, stream_timeout_s=600, max_idle_streams=idle)
        self._model = model
        self._counter = 0

    async def send(self, request: BenchRequest, record: RequestRecord) -> None:
        self._counter += 1
        call = InferenceCall(
            request_id=f"bench-{self._counter}",
            model=self._model,
            prompt=request.prompt,
            sampling=Sampling(max_tokens=request.max_tokens, ignore_eos=True),
        )
        async for chunk in self._backend.generate(call):
            now = time.perf_counter()
            if chunk.text:
                record.first_token_at = record.first_token_at or now
                record.chunk_times.append(now)
            record.output_tokens += chunk.num_tokens
        record.finished_at = time.perf_counter()

    async def close(self) -> None:
        await self._backend.close()

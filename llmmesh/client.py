"""A small client of the public Generation API (used by the CLI, the demo and the tests)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import grpc

from llmmesh.runtime.internal_auth import token_metadata
from llmmesh.v1 import common_pb2, generation_pb2, generation_pb2_grpc

DEFAULT_STATE_FILE = Path(".llm-mesh/state.json")
DEFAULT_ROUTER = "127.0.0.1:50051"


def router_address(explicit: str | None = None, state_file: Path = DEFAULT_STATE_FILE) -> str:
    """--router, then $LLM_MESH_ROUTER_ADDRESS, then the state file of `llm-mesh up`."""
    if explicit:
        return explicit
    if env := os.environ.get("LLM_MESH_ROUTER_ADDRESS"):
        return env
    if state_file.exists():
        return str(json.loads(state_file.read_text())["router"])
    return DEFAULT_ROUTER


def api_key(state_file: Path = DEFAULT_STATE_FILE) -> str:
    """$LLM_MESH_API_KEY, then the demo tenant's key in the state file of `llm-mesh up`."""
    if env := os.environ.get("LLM_MESH_API_KEY"):
        return env
    if state_file.exists():
        return str(json.loads(state_file.read_text()).get("api_key", ""))
    return ""


def auth_metadata(key: str) -> tuple[tuple[str, str], ...]:
    """The call metadata that presents ``key`` (none without a key)."""
    return (("authorization", f"Bearer {key}"),) if key else ()


class _CallDetails(
    NamedTuple(
        "_CallDetails",
        [
            ("method", str),
            ("timeout", float | None),
            ("metadata", Any),
            ("credentials", Any),
            ("wait_for_ready", bool | None),
            ("compression", Any),
        ],
    ),
    grpc.ClientCallDetails,
):
    pass


class _Metadata(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds fixed metadata to every call of a channel."""

    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self._metadata = metadata

    def _details(self, d: Any) -> _CallDetails:
        metadata = (*(d.metadata or ()), *self._metadata)
        return _CallDetails(
            d.method, d.timeout, metadata, d.credentials, d.wait_for_ready, d.compression
        )

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)

    def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)


def authorized_channel(address: str, key: str) -> grpc.Channel:
    """A channel to a router whose every call presents ``key``."""
    return grpc.intercept_channel(grpc.insecure_channel(address), _Metadata(auth_metadata(key)))


def internal_channel(address: str, token: str) -> grpc.Channel:
    """A channel to an internal service (context, policy, inference) whose every call
    presents the mesh's token (an operator's tools, the tests)."""
    return grpc.intercept_channel(grpc.insecure_channel(address), _Metadata(token_metadata(token)))


@dataclass
class StreamStats:
    """What a client observed of one stream."""

    started: float = field(default_factory=time.perf_counter)
    first_token_at: float = 0.0
    finished_at: float = 0.0
    completion_tokens: int = 0
    prompt_tokens: int = 0
    finish_reason: str = ""
    request_id: str = ""
    served_by: str = ""  # subset@region (endpoint), from the last response

    @property
    def ttft_s(self) -> float:
        return self.first_token_at - self.started if self.first_token_at else float("nan")

    @property
    def decode_tokens_per_s(self) -> float:
        span = self.finished_at - self.first_token_at
        return (
            (self.completion_tokens - 1) / span if span > 0 and self.completion_tokens > 1 else 0.0
        )

    def summary(self) -> str:
        return (
            f"TTFT {self.ttft_s * 1000:.1f} ms, {self.completion_tokens} tokens, "
            f"{self.decode_tokens_per_s:.1f} tokens/s, finish_reason={self.finish_reason}, "
            f"request_id={self.request_id}"
            + (f", served by {self.served_by}" if self.served_by else "")
        )


def build_request(
    prompt: str,
    *,
    model: str = "",
    max_tokens: int = 0,
    temperature: float | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    stop_token_ids: list[int] | None = None,
    include_stop_str_in_output: bool = False,
    allowed_token_ids: list[int] | None = None,
    bad_words: list[str] | None = None,
    seed: int | None = None,
    stop: list[str] | None = None,
    session_id: str = "",
    ignore_eos: bool = False,
    truncation: str = "",
    presence_penalty: float | None = None,
    frequency_penalty: float | None = None,
    repetition_penalty: float | None = None,
    logit_bias: dict[int, float] | None = None,
    structured_output: common_pb2.StructuredOutput | None = None,
) -> generation_pb2.GenerateRequest:
    sampling = common_pb2.SamplingParams(
        max_tokens=max_tokens,
        stop=stop or [],
        ignore_eos=ignore_eos,
        presence_penalty=presence_penalty,
        frequency_penalty=frequency_penalty,
        repetition_penalty=repetition_penalty,
        logit_bias=logit_bias,
        structured_output=structured_output,
        min_p=min_p,
        stop_token_ids=stop_token_ids or [],
        include_stop_str_in_output=include_stop_str_in_output,
        allowed_token_ids=allowed_token_ids or [],
        bad_words=bad_words or [],
    )
    if temperature is not None:
        sampling.temperature = temperature
    if top_p is not None:
        sampling.top_p = top_p
    if seed is not None:
        sampling.seed = seed
    return generation_pb2.GenerateRequest(
        model=model, prompt=prompt, sampling=sampling, session_id=session_id, truncation=truncation
    )


def stream_text(
    channel: grpc.Channel,
    request: generation_pb2.GenerateRequest,
    stats: StreamStats,
    timeout_s: float | None = None,
    metadata: tuple[tuple[str, str], ...] = (),
) -> Iterator[str]:
    """Yields text deltas as they arrive and fills ``stats``; raises grpc.RpcError on failure."""
    stub = generation_pb2_grpc.GenerationStub(channel)
    for reply in stub.Generate(request, timeout=timeout_s, metadata=metadata):
        now = time.perf_counter()
        if reply.request_id:
            stats.request_id = reply.request_id
        if reply.text:
            stats.first_token_at = stats.first_token_at or now
            yield reply.text
        if reply.finish_reason:
            stats.finished_at = now
            stats.finish_reason = common_pb2.FinishReason.Name(reply.finish_reason)
            stats.finish_reason = stats.finish_reason.removeprefix("FINISH_REASON_").lower()
            stats.completion_tokens = reply.usage.completion_tokens
            stats.prompt_tokens = reply.usage.prompt_tokens
            served = reply.served
            if served.endpoint:
                stats.served_by = f"{served.subset}@{served.region} ({served.endpoint})"

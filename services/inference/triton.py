"""Streams one generation from Triton with ``tritonclient`` (vLLM backend tensor contract)."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from typing import Any

import grpc
import numpy as np
import tritonclient.grpc.aio as triton_aio
from tritonclient.grpc import InferInput, InferRequestedOutput
from tritonclient.utils import InferenceServerException

from llmmesh.runtime.errors import InvalidArgument, MeshError, Unavailable
from llmmesh.types import Chunk, FinishReason, InferenceCall

OUTPUTS = ("text_output", "finish_reason", "num_output_tokens")
_FIELD_ERROR = re.compile(r"^(text_input|stream|sampling_parameters[.\w]*): (.+)$", re.S)


def build_inputs(call: InferenceCall, stream: bool = True) -> list[InferInput]:
    """The vLLM backend's inputs for ``call``."""

    def tensor(name: str, dtype: str, value: object) -> InferInput:
        array = np.array([value], dtype=np.object_ if dtype == "BYTES" else np.bool_)
        item = InferInput(name, [1], dtype)
        item.set_data_from_numpy(array)
        return item

    return [
        tensor("text_input", "BYTES", call.prompt.encode("utf-8")),
        tensor("stream", "BOOL", stream),
        tensor("sampling_parameters", "BYTES", call.sampling.to_vllm_json().encode()),
        tensor("exclude_input_in_output", "BOOL", True),
    ]


class TritonBackend:
    """A long-lived client of one Triton server; one gRPC stream per generation."""

    def __init__(self, url: str, stream_timeout_s: float) -> None:
        self.url = url
        self._timeout = stream_timeout_s
        self._client = triton_aio.InferenceServerClient(url)

    async def close(self) -> None:
        await self._client.close()

    async def is_ready(self, model: str) -> bool:
        try:
            return bool(await self._client.is_model_ready(model))
        except InferenceServerException:
            return False

    async def generate(self, call: InferenceCall) -> AsyncIterator[Chunk]:
        """Yields text chunks; closing the iterator early cancels the request in Triton."""

        async def requests() -> AsyncIterator[dict[str, object]]:
            yield {
                "model_name": call.model,
                "inputs": build_inputs(call),
                "outputs": [InferRequestedOutput(name) for name in OUTPUTS],
                "request_id": call.request_id,
            }

        responses = self._client.stream_infer(requests(), stream_timeout=self._timeout)
        try:
            while True:
                result, error = await self._next(responses)
                if error is not None:
                    raise _stream_error(error, call.model)
                chunk = _chunk(result)
                yield chunk
                if chunk.finish_reason is not None:
                    return
        finally:
            responses.cancel()

    async def _next(self, responses: Any) -> tuple[Any, InferenceServerException | None]:
        """The next stream item; transport failures become Unavailable."""
        try:
            item: tuple[Any, InferenceServerException | None] = await responses.__anext__()
        except StopAsyncIteration:
            raise Unavailable(f"Triton at {self.url} ended the stream early") from None
        except grpc.aio.AioRpcError as exc:
            raise Unavailable(f"Triton at {self.url} is unavailable: {exc.details()}") from None
        except InferenceServerException as exc:
            raise Unavailable(f"Triton at {self.url} is unavailable: {exc.message()}") from None
        return item


def _chunk(result: Any) -> Chunk:
    text = result.as_numpy("text_output")
    reason = result.as_numpy("finish_reason")
    tokens = result.as_numpy("num_output_tokens")
    reason_text = reason[0].decode() if reason is not None and len(reason) else ""
    return Chunk(
        text=text[0].decode("utf-8") if text is not None and len(text) else "",
        num_tokens=int(tokens[0]) if tokens is not None and len(tokens) else 0,
        finish_reason=FinishReason(reason_text) if reason_text else None,
    )


def _stream_error(error: InferenceServerException, model: str) -> MeshError:
    message = error.message() or str(error)
    if "unknown model" in message or "is not found" in message:
        return InvalidArgument("model", f"model '{model}' is not served by Triton")
    match = _FIELD_ERROR.match(message)
    if match:
        return InvalidArgument(match.group(1), match.group(2))
    return Unavailable(f"Triton failed the request: {message}")

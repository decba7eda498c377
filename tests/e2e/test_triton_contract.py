"""Triton itself speaks the vLLM backend's contract, so genuine Triton clients work."""

from __future__ import annotations

import json
import queue
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as triton_grpc
from tritonclient.utils import InferenceServerException

from llmmesh.launcher import Stack


def _inputs(prompt: str, stream: bool, params: dict[str, Any]) -> list[triton_grpc.InferInput]:
    def tensor(name: str, value: Any, dtype: str) -> triton_grpc.InferInput:
        item = triton_grpc.InferInput(name, [1], dtype)
        item.set_data_from_numpy(np.array([value], dtype=np.object_ if dtype == "BYTES" else bool))
        return item

    return [
        tensor("text_input", prompt.encode(), "BYTES"),
        tensor("stream", stream, "BOOL"),
        tensor("sampling_parameters", json.dumps(params).encode(), "BYTES"),
        tensor("exclude_input_in_output", True, "BOOL"),
    ]


def _stream(stack: Stack, prompt: str, params: dict[str, Any]) -> list[Any]:
    """A plain tritonclient streaming request, as Triton's own docs show it."""
    results: queue.Queue[Any] = queue.Queue()
    client = triton_grpc.InferenceServerClient(stack.address("triton_grpc"))
    client.start_stream(callback=lambda result, error: results.put(error or result))
    try:
        client.async_stream_infer(
            "llm",
            _inputs(prompt, True, params),
            request_id="contract-1",
            outputs=[
                triton_grpc.InferRequestedOutput(name)
                for name in ("text_output", "finish_reason", "num_output_tokens")
            ],
        )
        items = []
        while True:
            item = results.get(timeout=30)
            items.append(item)
            if isinstance(item, InferenceServerException):
                return items
            if item.as_numpy("finish_reason")[0]:
                return items
    finally:
        client.stop_stream()
        client.close()


def test_streaming_request_with_the_vllm_contract(stack: Stack) -> None:
    sampling = {"max_tokens": 200, "temperature": 0, "ignore_eos": True}
    items = _stream(stack, "Hello Triton", sampling)
    assert all(not isinstance(i, Exception) for i in items)
    texts = [i.as_numpy("text_output")[0].decode() for i in items]
    tokens = [int(i.as_numpy("num_output_tokens")[0]) for i in items]
    reasons = [i.as_numpy("finish_reason")[0].decode() for i in items]
    # Streamed: more than one response. How many depends on load: the outbox merges the
    # tokens of a stream whose sender lags (seen: 1 response for 12 tokens in CI), so the
    # generation is long enough that the sender cannot lag all through it.
    assert len(items) >= 2
    assert sum(tokens) == 200
    assert len("".join(texts)) == 200
    assert reasons[-1] == "length" and not any(reasons[:-1])


def test_invalid_sampling_parameters_are_reported(stack: Stack) -> None:
    items = _stream(stack, "x", {"top_p": 2})
    assert isinstance(items[-1], InferenceServerException)
    assert "sampling_parameters.top_p" in items[-1].message()


def test_non_streaming_request_returns_prompt_and_text(stack: Stack) -> None:
    client = triton_grpc.InferenceServerClient(stack.address("triton_grpc"))
    results: queue.Queue[Any] = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put(error or result))
    try:
        inputs = _inputs("Prefix: ", False, {"max_tokens": 5, "seed": 1, "ignore_eos": True})
        inputs[3].set_data_from_numpy(np.array([False]))
        client.async_stream_infer("llm", inputs)
        result = results.get(timeout=30)
    finally:
        client.stop_stream()
        client.close()
    text = result.as_numpy("text_output")[0].decode()
    assert text.startswith("Prefix: ") and len(text) == len("Prefix: ") + 5
    assert result.as_numpy("finish_reason")[0] == b"length"


@pytest.mark.parametrize("model", ["llm"])
def test_model_metadata_declares_the_contract(stack: Stack, model: str) -> None:
    client = triton_grpc.InferenceServerClient(stack.address("triton_grpc"))
    try:
        meta = client.get_model_metadata(model, as_json=True)
    finally:
        client.close()
    assert {i["name"] for i in meta["inputs"]} >= {
        "text_input",
        "stream",
        "sampling_parameters",
        "exclude_input_in_output",
    }
    assert {o["name"] for o in meta["outputs"]} == {
        "text_output",
        "finish_reason",
        "num_output_tokens",
    }

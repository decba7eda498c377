"""Triton itself speaks the vLLM backend's contract, so genuine Triton clients work."""

from __future__ import annotations

import json
import queue
import uuid
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as triton_grpc
from tritonclient.utils import InferenceServerException

from llmmesh.launcher import Stack

BASIC_OUTPUTS = ("text_output", "finish_reason", "num_output_tokens")
EXTRA_OUTPUTS = (
    "logprobs",
    "cumulative_logprob",
    "num_input_tokens",
    "num_cached_tokens",
    "prompt_logprobs",
    "prompt_token_ids",
)


def _tensor(name: str, value: Any, dtype: str) -> triton_grpc.InferInput:
    item = triton_grpc.InferInput(name, [1], dtype)
    item.set_data_from_numpy(np.array([value], dtype=np.object_ if dtype == "BYTES" else bool))
    return item


def _inputs(prompt: str, stream: bool, params: dict[str, Any]) -> list[triton_grpc.InferInput]:
    return [
        _tensor("text_input", prompt.encode(), "BYTES"),
        _tensor("stream", stream, "BOOL"),
        _tensor("sampling_parameters", json.dumps(params).encode(), "BYTES"),
        _tensor("exclude_input_in_output", True, "BOOL"),
    ]


def _stream(
    stack: Stack,
    prompt: str,
    params: dict[str, Any],
    flags: tuple[str, ...] = (),
    outputs: tuple[str, ...] = BASIC_OUTPUTS,
    parameters: dict[str, Any] | None = None,
    extra: tuple[triton_grpc.InferInput, ...] = (),
) -> list[Any]:
    """A plain tritonclient streaming request, as Triton's own docs show it; ``flags``:
    optional BOOL inputs set true (the vLLM backend's ``return_*``); ``parameters``: the
    request's parameters; ``extra``: other inputs."""
    results: queue.Queue[Any] = queue.Queue()
    client = triton_grpc.InferenceServerClient(stack.address("triton_grpc"))
    client.start_stream(callback=lambda result, error: results.put(error or result))
    try:
        client.async_stream_infer(
            "llm",
            _inputs(prompt, True, params) + [_tensor(f, True, "BOOL") for f in flags] + [*extra],
            request_id="contract-1",
            outputs=[triton_grpc.InferRequestedOutput(name) for name in outputs],
            parameters=parameters,
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


def _texts(items: list[Any]) -> list[str]:
    return [i.as_numpy("text_output")[0].decode() for i in items]


def test_a_requests_stream_gap_sends_the_same_text_in_fewer_responses(stack: Stack) -> None:
    """A second's gap after its first two responses: a generation far shorter than that
    sends the rest with its last response, which never waits."""
    sampling = {"max_tokens": 60, "temperature": 0, "ignore_eos": True}
    plain = _stream(stack, "Hello Triton", sampling)
    gap = {"stream_gap_ms": 1000.0, "stream_gap_after": 2}
    held = _stream(stack, "Hello Triton", sampling, parameters=gap)
    assert "".join(_texts(held)) == "".join(_texts(plain)) and len(_texts(plain)[0]) >= 1
    assert 2 <= len(held) <= 4  # the first two (merged when the sender lags), the last
    assert sum(int(i.as_numpy("num_output_tokens")[0]) for i in held) == 60


@pytest.mark.parametrize(("name", "value"), [("stream_gap_ms", -1), ("stream_gap_after", "many")])
def test_a_stream_gap_out_of_range_is_refused_by_name(stack: Stack, name: str, value: Any) -> None:
    parameters = {"stream_gap_ms": 8, name: value}
    items = _stream(stack, "x", {"max_tokens": 2}, parameters=parameters)
    assert isinstance(items[-1], InferenceServerException)
    assert name in items[-1].message()


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
    assert {o["name"] for o in meta["outputs"]} == {*BASIC_OUTPUTS, *EXTRA_OUTPUTS}


def test_logprobs_and_the_optional_outputs_as_the_vllm_backend_sends_them(stack: Stack) -> None:
    sampling = {"max_tokens": 12, "temperature": 0, "ignore_eos": True, "logprobs": 3}
    flags = ("return_logprobs", "return_cumulative_logprob", "return_num_input_tokens")
    items = _stream(stack, "Hello", sampling, flags, BASIC_OUTPUTS + EXTRA_OUTPUTS)
    assert all(not isinstance(i, Exception) for i in items)
    positions = [p for i in items for p in json.loads(i.as_numpy("logprobs")[0])]
    assert len(positions) == sum(int(i.as_numpy("num_output_tokens")[0]) for i in items) == 12
    sampled = []
    for position in positions:  # greedy: the sampled token is the most likely, rank 1
        ranked = sorted(position.values(), key=lambda e: e["rank"])
        assert [e["rank"] for e in ranked] == [1, 2, 3]
        assert ranked[0]["logprob"] >= ranked[1]["logprob"] >= ranked[2]["logprob"]
        sampled.append(ranked[0]["logprob"])
    cumulative = float(items[-1].as_numpy("cumulative_logprob")[0])
    assert cumulative == pytest.approx(sum(sampled), rel=1e-5)
    assert int(items[-1].as_numpy("num_input_tokens")[0]) == len("Hello") + 1  # and BOS


def test_the_first_response_says_what_the_prefix_cache_held(stack: Stack) -> None:
    """The engine's own optional output: on the first response, the prompt's tokens read
    from the prefix cache (whole blocks of 16); a prompt seen before is mostly cached."""
    prompt = f"{uuid.uuid4().hex} " * 4  # 132 characters: never seen, 8 full blocks later
    sampling = {"max_tokens": 3, "temperature": 0, "ignore_eos": True}
    flags = ("return_num_cached_tokens",)

    def cached() -> list[int]:
        items = _stream(stack, prompt, sampling, flags, (*BASIC_OUTPUTS, "num_cached_tokens"))
        assert all(not isinstance(i, Exception) for i in items)
        return [
            int(i.as_numpy("num_cached_tokens")[0])
            for i in items
            if i.as_numpy("num_cached_tokens") is not None
        ]

    assert cached()[:1] == [0]
    assert cached()[:1] == [128]  # 133 tokens with BOS: 8 blocks, one token left to compute


def test_the_first_response_has_the_prompts_ids_when_asked(stack: Stack) -> None:
    """The engine's own optional output (vLLM's return_token_ids): an INT32 tensor of the
    prompt's ids as the engine read it, BOS first, on the first response only."""
    sampling = {"max_tokens": 3, "temperature": 0, "ignore_eos": True}
    outputs = (*BASIC_OUTPUTS, "prompt_token_ids")
    items = _stream(stack, "Hi!", sampling, ("return_prompt_token_ids",), outputs)
    assert all(not isinstance(i, Exception) for i in items)
    reported = [i.as_numpy("prompt_token_ids") for i in items]
    assert reported[0] is not None and reported[0].tolist() == [256, *b"Hi!"]
    assert all(r is None for r in reported[1:])
    plain = _stream(stack, "Hi!", sampling, (), outputs)
    assert all(i.as_numpy("prompt_token_ids") is None for i in plain)


def test_prompt_logprobs_come_with_the_first_response_and_read_no_cache(stack: Stack) -> None:
    """vLLM's prompt_logprobs in sampling_parameters: an entry per prompt token (BOS, which
    the engine adds, is not the prompt's), on the first response only; the prompt is
    computed whole even when its blocks are cached."""
    prompt = f"scored {uuid.uuid4().hex} " * 2
    sampling = {"max_tokens": 3, "temperature": 0, "ignore_eos": True, "prompt_logprobs": 2}
    outputs = (*BASIC_OUTPUTS, "num_cached_tokens", "prompt_logprobs")
    for _ in range(2):  # the second time, its blocks are in the prefix cache
        items = _stream(stack, prompt, sampling, ("return_num_cached_tokens",), outputs)
        assert all(not isinstance(i, Exception) for i in items)
        scored = [i.as_numpy("prompt_logprobs") for i in items]
        assert all(s is None for s in scored[1:])
        positions = json.loads(scored[0][0])
        assert len(positions) == len(prompt.encode())
        for position, byte in zip(positions, prompt.encode(), strict=True):
            own = position[str(byte)]
            assert own["rank"] >= 1 and own["logprob"] <= 0.0
            assert {e["rank"] for e in position.values()} >= {1, 2}
        assert int(items[0].as_numpy("num_cached_tokens")[0]) == 0


def _ids(values: list[int]) -> triton_grpc.InferInput:
    ids = triton_grpc.InferInput("input_ids", [len(values)], "INT32")
    ids.set_data_from_numpy(np.array(values, dtype=np.int32))
    return ids


def test_a_prompt_of_token_ids_is_read_as_given(stack: Stack) -> None:
    """The optional input ``input_ids`` (TensorRT-LLM's name): the text's own tokens, BOS
    included, give the text's output; text_input is then only the prompt's text."""
    sampling = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}
    by_text = "".join(_texts(_stream(stack, "Hello", sampling)))
    by_ids = _stream(stack, "Hello", sampling, extra=(_ids([256, *b"Hello"]),))
    assert "".join(_texts(by_ids)) == by_text and len(by_text) == 6
    refused = _stream(stack, "Hello", sampling, extra=(_ids([256, 300]),))
    assert isinstance(refused[-1], InferenceServerException)
    assert "input_ids[1]: 300 is not a token" in str(refused[-1])

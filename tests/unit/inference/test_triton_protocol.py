"""Building vLLM-contract requests and reading responses in Triton's raw tensor layout."""

from __future__ import annotations

import asyncio
import json
import struct
from dataclasses import replace
from types import SimpleNamespace

import grpc
import pytest
from tritonclient.grpc import service_pb2

from llmmesh.runtime.errors import InvalidArgument, Unavailable
from llmmesh.types import FinishReason, InferenceCall, ModelCard, Sampling, TokenLogprob
from services.inference.config import InferenceConfig
from services.inference.replica import triton_backend
from services.inference.triton import (
    StreamGap,
    TritonBackend,
    _stream_error,
    build_request,
    bytes_tensor,
    first_bytes_element,
    parse_logprobs,
    parse_response,
)


def test_request_carries_the_vllm_inputs() -> None:
    call = InferenceCall("r-1", "llm", "héllo", Sampling(max_tokens=5, temperature=0.0, seed=3))
    request = build_request(call)
    assert (request.model_name, request.id) == ("llm", "r-1")
    inputs = {
        i.name: (i.datatype, raw)
        for i, raw in zip(request.inputs, request.raw_input_contents, strict=True)
    }
    assert first_bytes_element(inputs["text_input"][1]).decode() == "héllo"
    assert inputs["stream"] == ("BOOL", b"\x01")
    assert inputs["exclude_input_in_output"] == ("BOOL", b"\x01")
    params = json.loads(first_bytes_element(inputs["sampling_parameters"][1]))
    assert params == {"max_tokens": 5, "temperature": 0.0, "top_p": 1.0, "seed": 3}
    assert [o.name for o in request.outputs] == [
        "text_output",
        "finish_reason",
        "num_output_tokens",
    ]


def test_response_is_read_from_raw_outputs_in_any_order() -> None:
    response = service_pb2.ModelInferResponse()
    for name in ("num_output_tokens", "text_output", "finish_reason"):
        response.outputs.add(name=name)
    response.raw_output_contents.extend(
        [struct.pack("<I", 3), bytes_tensor(b"abc"), bytes_tensor(b"stop")]
    )
    chunk = parse_response(response)
    assert (chunk.text, chunk.num_tokens, chunk.finish_reason) == ("abc", 3, FinishReason.STOP)


def test_intermediate_response_has_no_finish_reason() -> None:
    response = service_pb2.ModelInferResponse()
    for name in ("text_output", "finish_reason", "num_output_tokens"):
        response.outputs.add(name=name)
    response.raw_output_contents.extend(
        [bytes_tensor(b"x"), bytes_tensor(b""), struct.pack("<I", 1)]
    )
    assert parse_response(response).finish_reason is None


@pytest.mark.parametrize(
    ("message", "kind", "field"),
    [
        (
            "sampling_parameters.top_p: must be in (0, 1], got 2",
            InvalidArgument,
            "sampling.top_p",
        ),
        (
            "text_input: prompt is 3000 tokens; the model's context is 2048",
            InvalidArgument,
            "text_input",
        ),
        (  # the request's fault, not the replica's: never counted against it
            "input_ids[1]: 300 is not a token (0-257)",
            InvalidArgument,
            "input_ids[1]",
        ),
        (  # a structure the model cannot write: under the mesh's name of the field
            "sampling_parameters.structured_outputs: no token the model may write continues",
            InvalidArgument,
            "sampling.structured_output",
        ),
        ("Request for unknown model: 'x' is not found", InvalidArgument, "model"),
        ("generation failed: out of memory", Unavailable, None),
    ],
)
def test_model_errors_map_to_statuses(message: str, kind: type, field: str | None) -> None:
    err = _stream_error(message, "x")
    assert isinstance(err, kind)
    if field is not None:
        assert isinstance(err, InvalidArgument) and err.field == field


def test_logprobs_are_asked_for_only_when_the_call_wants_them() -> None:
    plain = build_request(InferenceCall("r", "llm", "hi", Sampling(max_tokens=2)))
    assert "return_logprobs" not in {i.name for i in plain.inputs}
    scored = build_request(InferenceCall("r", "llm", "hi", Sampling(max_tokens=2, logprobs=2)))
    assert "return_logprobs" in {i.name for i in scored.inputs}
    assert "logprobs" in {o.name for o in scored.outputs}
    params = json.loads(first_bytes_element(scored.raw_input_contents[2]))
    assert params["logprobs"] == 2


def test_cached_tokens_are_asked_for_only_of_a_model_that_declares_them() -> None:
    call = InferenceCall("r", "llm", "hi", Sampling(max_tokens=2))
    assert "return_num_cached_tokens" not in {i.name for i in build_request(call).inputs}
    asked = build_request(call, cached_tokens=True)
    assert "return_num_cached_tokens" in {i.name for i in asked.inputs}
    assert "num_cached_tokens" in {o.name for o in asked.outputs}
    response = service_pb2.ModelInferResponse()
    for name, raw in (
        ("text_output", bytes_tensor(b"a")),
        ("num_output_tokens", struct.pack("<I", 1)),
        ("num_cached_tokens", struct.pack("<I", 48)),
    ):
        response.outputs.add(name=name)
        response.raw_output_contents.append(raw)
    assert parse_response(response).cached_tokens == 48
    del response.outputs[-1], response.raw_output_contents[-1]
    assert parse_response(response).cached_tokens == 0  # a later response, or vLLM's


def test_the_vllm_logprobs_output_is_read_with_the_top_tokens_in_rank_order() -> None:
    # The sampled token first (here the 5th most likely), then the two most likely.
    raw = json.dumps(
        [
            {
                "7": {"logprob": -3.0, "rank": 5, "decoded_token": " cat"},
                "9": {"logprob": -0.2, "rank": 1, "decoded_token": " dog"},
                "4": {"logprob": -1.9, "rank": 2, "decoded_token": " fox"},
            }
        ]
    ).encode()
    (token,) = parse_logprobs(raw, top=2)
    assert token == TokenLogprob(7, " cat", -3.0, 5, ((9, " dog", -0.2), (4, " fox", -1.9)))
    with pytest.raises(Unavailable, match="do not parse"):
        parse_logprobs(b'[{"7": {"rank": 1}}]', top=1)


def test_a_priority_travels_as_the_scheduling_priority_parameter() -> None:
    call = InferenceCall("r", "llm", "hi", Sampling(max_tokens=1))
    assert "scheduling_priority" not in build_request(call).parameters
    urgent = build_request(InferenceCall("r", "llm", "hi", Sampling(max_tokens=1), priority=0))
    assert urgent.parameters["scheduling_priority"].int64_param == 0
    assert urgent.parameters["scheduling_priority"].HasField("int64_param")


def test_a_cache_salt_travels_as_the_cache_salt_parameter() -> None:
    call = InferenceCall("r", "llm", "hi", Sampling(max_tokens=1))
    assert "cache_salt" not in build_request(call).parameters
    salted = build_request(InferenceCall("r", "llm", "hi", Sampling(max_tokens=1), cache_salt="s"))
    assert salted.parameters["cache_salt"].string_param == "s"


def test_resumed_output_travels_as_a_parameter_where_the_engine_reads_it() -> None:
    plain = InferenceCall("r", "llm", "hi there", Sampling(max_tokens=1), resumed_output_chars=5)
    assert "resumed_output_chars" not in build_request(plain).parameters
    greedy = replace(plain, sampling=Sampling(max_tokens=1, temperature=0.0, seed=3))
    assert "resumed_output_chars" not in build_request(greedy).parameters
    for sampling in (
        Sampling(max_tokens=1, seed=3),  # its draws go on from their place
        Sampling(max_tokens=1, structured=("regex", "[a-z]+")),  # its grammar goes on
    ):
        parameters = build_request(replace(plain, sampling=sampling)).parameters
        assert parameters["resumed_output_chars"].int64_param == 5
    penalized = replace(plain, sampling=Sampling(max_tokens=1, frequency_penalty=0.5))
    assert build_request(penalized).parameters["resumed_output_chars"].int64_param == 5
    request = build_request(penalized)
    raw = request.raw_input_contents[[i.name for i in request.inputs].index("sampling_parameters")]
    sent = json.loads(first_bytes_element(raw))
    assert sent["frequency_penalty"] == 0.5 and "presence_penalty" not in sent


def test_a_stream_gap_travels_as_the_engines_parameters_and_none_is_not_sent() -> None:
    call = InferenceCall("r", "llm", "hi", Sampling(max_tokens=1))
    assert "stream_gap_ms" not in build_request(call).parameters
    gapped = build_request(call, gap=StreamGap(0.008, 3)).parameters
    assert gapped["stream_gap_ms"].double_param == 8.0
    assert gapped["stream_gap_after"].int64_param == 3


def test_a_replica_asks_the_engine_for_its_configured_stream_gap() -> None:
    async def gaps() -> tuple[StreamGap, StreamGap]:
        default = triton_backend(InferenceConfig())
        tuned = triton_backend(InferenceConfig(engine_stream_gap_ms=12, engine_stream_gap_after=3))
        try:
            return default.gap, tuned.gap
        finally:
            await default.close()
            await tuned.close()

    assert asyncio.run(gaps()) == (StreamGap(0.008, 8), StreamGap(0.012, 3))


class _CardStream:
    """One ModelStreamInfer call as describe() uses it; ``reply`` None: Triton ends the
    stream before answering."""

    def __init__(self, reply: service_pb2.ModelStreamInferResponse | None) -> None:
        self.reply = reply
        self.half_closed = False
        self.cancelled = False
        self.waited_for_its_end = False

    async def write(self, request: service_pb2.ModelInferRequest) -> None:
        assert request.parameters["model_card"].bool_param

    async def done_writing(self) -> None:
        self.half_closed = True

    async def read(self) -> object:
        return self.reply if self.reply is not None else grpc.aio.EOF

    async def code(self) -> grpc.StatusCode:
        self.waited_for_its_end = self.half_closed
        return grpc.StatusCode.OK

    def cancel(self) -> None:
        self.cancelled = True


def _describe(stream: _CardStream) -> ModelCard:
    async def main() -> ModelCard:
        backend = TritonBackend("127.0.0.1:1", stream_timeout_s=5)
        backend._stub = SimpleNamespace(ModelStreamInfer=lambda timeout: stream)

        async def connected() -> None:
            return None

        backend._connected = connected  # type: ignore[method-assign]
        try:
            return await backend.describe("llm")
        finally:
            await backend.close()

    return asyncio.run(main())


def test_a_card_stream_is_ended_by_triton_never_cancelled_once_answered() -> None:
    """Triton 2.51 waits forever for the cancellation of a stream whose request it has
    finished, and keeps the model loaded at shutdown until its exit timeout."""
    response = service_pb2.ModelInferResponse(model_name="llm", id="model-card")
    response.outputs.add(name="text_output", datatype="BYTES", shape=[1])
    response.raw_output_contents.append(bytes_tensor(json.dumps({"max_context": 256}).encode()))
    stream = _CardStream(service_pb2.ModelStreamInferResponse(infer_response=response))
    assert _describe(stream).max_context == 256
    assert stream.half_closed and stream.waited_for_its_end and not stream.cancelled


def test_a_card_stream_that_broke_before_the_answer_is_cancelled() -> None:
    stream = _CardStream(None)
    with pytest.raises(Unavailable):
        _describe(stream)
    assert stream.cancelled


def test_prompt_logprobs_are_asked_as_vllms_and_read_from_their_output() -> None:
    """In sampling_parameters (vLLM's key), the output asked for; the first token, which
    nothing precedes, has a null rank and log probability: rank 0."""
    call = InferenceCall("r", "llm", "hi", Sampling(max_tokens=2, prompt_logprobs=1))
    request = build_request(call)
    assert "prompt_logprobs" in {o.name for o in request.outputs}
    assert json.loads(first_bytes_element(request.raw_input_contents[2]))["prompt_logprobs"] == 1
    positions = [
        {"104": {"logprob": None, "rank": None, "decoded_token": "h"}},
        {"105": {"logprob": -2.0, "rank": 3, "decoded_token": "i"}, "33": {
            "logprob": -0.5, "rank": 1, "decoded_token": "!"}},
    ]  # fmt: skip
    response = service_pb2.ModelInferResponse()
    response.outputs.add(name="prompt_logprobs")
    response.raw_output_contents.append(bytes_tensor(json.dumps(positions).encode()))
    chunk = parse_response(response, call.sampling)
    assert chunk.prompt_logprobs == (
        TokenLogprob(104, "h", 0.0, 0),
        TokenLogprob(105, "i", -2.0, 3, ((33, "!", -0.5),)),
    )


def test_token_ids_ask_for_the_tokens_entries_and_the_prompts_ids() -> None:
    """vLLM's return_token_ids: each token's entry (logprobs 0: its own, which carries its
    id) and the engine's prompt_token_ids output, read as INT32s."""
    call = InferenceCall("r", "llm", "hi", Sampling(max_tokens=2, return_token_ids=True))
    request = build_request(call)
    assert {"return_logprobs", "return_prompt_token_ids"} <= {i.name for i in request.inputs}
    assert {"logprobs", "prompt_token_ids"} <= {o.name for o in request.outputs}
    assert json.loads(first_bytes_element(request.raw_input_contents[2]))["logprobs"] == 0
    response = service_pb2.ModelInferResponse()
    response.outputs.add(name="prompt_token_ids")
    response.raw_output_contents.append(struct.pack("<3i", 256, 104, 105))
    assert parse_response(response, call.sampling).prompt_token_ids == (256, 104, 105)
    resumed = call.sampling.without_prompt_reports()  # a stream resumed elsewhere
    again = build_request(replace(call, sampling=resumed))
    assert "return_prompt_token_ids" not in {i.name for i in again.inputs}
    assert "return_logprobs" in {i.name for i in again.inputs}


def test_a_prompt_of_ids_is_sent_as_the_input_ids_tensor() -> None:
    call = InferenceCall("r", "llm", "hi", Sampling(max_tokens=2), prompt_ids=(256, 104, 105))
    request = build_request(call)
    (ids,) = [
        (i, raw)
        for i, raw in zip(request.inputs, request.raw_input_contents, strict=True)
        if i.name == "input_ids"
    ]
    assert (ids[0].datatype, list(ids[0].shape)) == ("INT32", [3])
    assert struct.unpack("<3i", ids[1]) == (256, 104, 105)
    assert "input_ids" not in {i.name for i in build_request(replace(call, prompt_ids=())).inputs}


@pytest.mark.parametrize(
    ("call", "field"),
    [
        (
            InferenceCall("r", "llm", "hi", Sampling(max_tokens=2, prompt_logprobs=0)),
            "sampling.prompt_logprobs",
        ),
        (InferenceCall("r", "llm", "hi", Sampling(max_tokens=2), prompt_ids=(1, 2)), "prompt"),
        (
            InferenceCall("r", "llm", "hi", Sampling(max_tokens=2, return_token_ids=True)),
            "sampling.return_token_ids",
        ),
    ],
)
def test_what_a_model_does_not_take_is_refused_by_name(call: InferenceCall, field: str) -> None:
    """A vLLM backend's model declares no prompt_logprobs output and no input_ids: the
    request is refused naming the field (not sent to fail inside Triton)."""
    metadata = service_pb2.ModelMetadataResponse(name="llm")
    metadata.outputs.add(name="text_output")

    async def main() -> None:
        backend = TritonBackend("127.0.0.1:1", stream_timeout_s=5)

        async def described(request: object, **_: float) -> object:
            return metadata

        backend._stub = SimpleNamespace(ModelMetadata=described)  # no stream to start

        async def connected() -> None:
            return None

        backend._connected = connected  # type: ignore[method-assign]
        try:
            with pytest.raises(InvalidArgument) as refused:
                await anext(backend.generate(call))
            assert refused.value.field == field
        finally:
            await backend.close()

    asyncio.run(main())

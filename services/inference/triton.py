"""Streams one generation from Triton over its gRPC API (vLLM backend tensor contract).

Requests and responses use tritonclient's generated KServe-v2 protobufs directly, with
tensors in ``raw_*_contents``: per token this costs a fraction of tritonclient's
``InferResult`` conversions, and every token of every request crosses this code.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import struct
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from typing import Any

import grpc
from tritonclient.grpc import service_pb2, service_pb2_grpc

from llmmesh import first_tokens
from llmmesh.runtime.errors import InvalidArgument, MeshError, NotFound, Unavailable
from llmmesh.types import Chunk, FinishReason, InferenceCall, ModelCard, Sampling, TokenLogprob
from services.inference.health import EngineUnreachable
from services.inference.warm_streams import (
    CLOSE_WAIT_S,
    MAX_IDLE_STREAMS,
    WarmStreams,
    end_stream,
)

log = logging.getLogger(__name__)

OUTPUTS = ("text_output", "finish_reason", "num_output_tokens")
# Inputs whose name starts a model's refusal ("input_ids[3]: ...", "sampling_parameters.x:
# ..."): the request's fault, never the replica's.
_FIELDS = ("text_input", "stream", "sampling_parameters", "input_ids")
# Where the vLLM contract's name of a field is not the mesh's.
_MESH_FIELDS = {"sampling.structured_outputs": "sampling.structured_output"}
_LENGTH = struct.Struct("<I")
# Triton runs beside this service: after an outage, reconnect within a second of it being
# back, not after gRPC's default backoff (which grows to minutes).
RECONNECT_WAIT_S = 1.0
TRITON_CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]
_TRUE = b"\x01"
CACHED_TOKENS_FLAG = "return_num_cached_tokens"
PROMPT_LOGPROBS = "prompt_logprobs"  # an output the reference engine's models declare
PROMPT_IDS_FLAG = "return_prompt_token_ids"  # an input they declare, and its output:
PROMPT_IDS = "prompt_token_ids"
INPUT_IDS = "input_ids"  # an input they declare (TensorRT-LLM's name): the prompt's ids
PRIORITY_PARAMETER = "scheduling_priority"
RESUMED_OUTPUT_PARAMETER = "resumed_output_chars"
CACHE_SALT_PARAMETER = "cache_salt"
GAP_PARAMETER = "stream_gap_ms"
GAP_AFTER_PARAMETER = "stream_gap_after"


@dataclass(frozen=True)
class ModelReports:
    """What a model takes and reports beyond the vLLM backend's contract (the reference
    engine's models do): the prompt's tokens read from the prefix cache, the prompt's log
    probabilities, a prompt of token ids, the prompt's token ids."""

    cached_tokens: bool
    prompt_logprobs: bool
    input_ids: bool
    prompt_token_ids: bool


@dataclass(frozen=True)
class StreamGap:
    """Asks the engine to send a generation's responses at least ``seconds`` apart once
    its first ``after`` have gone, the text between them together: fewer responses, the
    same text; its last never waits. The reference engine reads it; others ignore it."""

    seconds: float = 0.0
    after: int = 0


def bytes_tensor(value: bytes) -> bytes:
    """One-element BYTES tensor in Triton's raw layout: 4-byte little-endian length, data."""
    return _LENGTH.pack(len(value)) + value


def first_bytes_element(raw: bytes) -> bytes:
    if len(raw) < _LENGTH.size:
        return b""
    (size,) = _LENGTH.unpack_from(raw)
    return raw[_LENGTH.size : _LENGTH.size + size]


def build_request(
    call: InferenceCall, cached_tokens: bool = False, gap: StreamGap = StreamGap()
) -> service_pb2.ModelInferRequest:
    """The vLLM backend's inputs for ``call``, streaming, prompt excluded from the output;
    ``cached_tokens``: ask for the prefix cache's share of the prompt too (an input the
    reference engine's models declare, the vLLM backend's do not); ``gap``: the
    engine's stream gap (none: the model's own)."""
    request = service_pb2.ModelInferRequest(model_name=call.model, id=call.request_id)
    inputs: Iterable[tuple[str, str, bytes]] = (
        ("text_input", "BYTES", bytes_tensor(call.prompt.encode("utf-8"))),
        ("stream", "BOOL", _TRUE),
        ("sampling_parameters", "BYTES", bytes_tensor(call.sampling.to_vllm_json().encode())),
        ("exclude_input_in_output", "BOOL", _TRUE),
    )
    outputs: tuple[str, ...] = OUTPUTS
    if call.sampling.scores_tokens:  # the vLLM backend's optional output
        inputs = (*inputs, ("return_logprobs", "BOOL", _TRUE))
        outputs = (*outputs, "logprobs")
    if call.sampling.return_token_ids:
        inputs = (*inputs, (PROMPT_IDS_FLAG, "BOOL", _TRUE))
        outputs = (*outputs, PROMPT_IDS)
    if cached_tokens:
        inputs = (*inputs, (CACHED_TOKENS_FLAG, "BOOL", _TRUE))
        outputs = (*outputs, "num_cached_tokens")
    if call.sampling.prompt_logprobs is not None:  # asked in sampling_parameters (vLLM's)
        outputs = (*outputs, PROMPT_LOGPROBS)
    for name, datatype, raw in inputs:
        request.inputs.add(name=name, datatype=datatype, shape=[1])
        request.raw_input_contents.append(raw)
    if call.prompt_ids:
        ids = call.prompt_ids
        request.inputs.add(name=INPUT_IDS, datatype="INT32", shape=[len(ids)])
        request.raw_input_contents.append(struct.pack(f"<{len(ids)}i", *ids))
    for name in outputs:
        request.outputs.add(name=name)
    if call.priority is not None:  # a parameter the model reads (tritonclient reserves "priority")
        request.parameters[PRIORITY_PARAMETER].int64_param = call.priority
    if call.cache_salt:
        request.parameters[CACHE_SALT_PARAMETER].string_param = call.cache_salt
    if call.resumed_output_chars and call.sampling.reads_earlier_output:
        request.parameters[RESUMED_OUTPUT_PARAMETER].int64_param = call.resumed_output_chars
    if gap.seconds > 0:
        request.parameters[GAP_PARAMETER].double_param = gap.seconds * 1000
        request.parameters[GAP_AFTER_PARAMETER].int64_param = gap.after
    return request


def _check_reported(call: InferenceCall, reports: ModelReports | None) -> None:
    """InvalidArgument naming what ``call`` asks of a model that does not take it."""
    if reports is None:  # not known now: the generation will say what is wrong
        return
    if call.sampling.prompt_logprobs is not None and not reports.prompt_logprobs:
        raise InvalidArgument(
            "sampling.prompt_logprobs",
            f"model '{call.model}' does not report its prompts' log probabilities",
        )
    if call.sampling.return_token_ids and not reports.prompt_token_ids:
        raise InvalidArgument(
            "sampling.return_token_ids", f"model '{call.model}' does not report its prompts' ids"
        )
    if call.prompt_ids and not reports.input_ids:
        raise InvalidArgument("prompt", f"model '{call.model}' takes no token ids: send text")


def build_card_request(model: str) -> service_pb2.ModelInferRequest:
    """Asks the model for its card instead of a generation (the request parameter
    ``model_card``, which the reference engine's models answer)."""
    request = service_pb2.ModelInferRequest(model_name=model, id="model-card")
    request.parameters["model_card"].bool_param = True
    request.inputs.add(name="text_input", datatype="BYTES", shape=[1])
    request.raw_input_contents.append(bytes_tensor(b""))
    request.outputs.add(name="text_output")
    return request


def parse_card(model: str, text: str) -> ModelCard:
    try:
        doc = json.loads(text)
        return ModelCard(
            model=model,
            max_context=int(doc["max_context"]),
            tokenizer_json=str(doc.get("tokenizer_json", "")),
            chat_template=str(doc.get("chat_template", "")),
            bos_token=str(doc.get("bos_token", "")),
            eos_token=str(doc.get("eos_token", "")),
            add_bos=bool(doc.get("add_bos", False)),
        )
    except (ValueError, KeyError, TypeError):
        raise Unavailable(f"model '{model}' does not describe itself (no model card)") from None


def _outputs(response: service_pb2.ModelInferResponse) -> dict[str, bytes]:
    return dict(zip((o.name for o in response.outputs), response.raw_output_contents, strict=False))


def parse_response(
    response: service_pb2.ModelInferResponse, sampling: Sampling | None = None
) -> Chunk:
    """One response as a chunk, its log probabilities with as many most likely tokens per
    position as ``sampling`` asked (None: the tokens' own only)."""
    top, prompt_top = (sampling.logprobs, sampling.prompt_logprobs) if sampling else (0, 0)
    raw = _outputs(response)
    reason = first_bytes_element(raw.get("finish_reason", b"")).decode()
    return Chunk(
        text=first_bytes_element(raw.get("text_output", b"")).decode("utf-8", "replace"),
        num_tokens=_uint32(raw.get("num_output_tokens", b"")),
        finish_reason=FinishReason(reason) if reason else None,
        logprobs=parse_logprobs(_bytes(raw, "logprobs"), top or 0),
        cached_tokens=_uint32(raw.get("num_cached_tokens", b"")),
        prompt_logprobs=parse_logprobs(_bytes(raw, PROMPT_LOGPROBS), prompt_top or 0),
        prompt_token_ids=_int32s(raw.get(PROMPT_IDS, b"")),
    )


def _bytes(raw: dict[str, bytes], name: str) -> bytes:
    return first_bytes_element(raw.get(name, b""))


def _uint32(raw: bytes) -> int:
    return _LENGTH.unpack_from(raw)[0] if len(raw) >= _LENGTH.size else 0


def _int32s(raw: bytes) -> tuple[int, ...]:
    """An INT32 tensor's values (raw little-endian)."""
    return tuple(struct.unpack(f"<{len(raw) // 4}i", raw[: len(raw) // 4 * 4]))


def parse_logprobs(raw: bytes, top: int) -> tuple[TokenLogprob, ...]:
    """The vLLM backend's ``logprobs`` output: per token, {token id: {logprob, rank,
    decoded_token}} holding the sampled token (first) and the ``top`` most likely ones
    (ranks 1 to ``top``; the sampled token is one of them or has a rank of its own)."""
    if not raw:  # most responses: none asked
        return ()
    try:
        return tuple(_position(p, top) for p in json.loads(raw))
    except (ValueError, KeyError, TypeError, IndexError, AttributeError):
        raise Unavailable("Triton sent log probabilities that do not parse") from None


def _position(position: dict[str, Any], top: int) -> TokenLogprob:
    """A position's entry; a prompt's first token has a null rank and log probability
    (nothing precedes it): rank 0."""
    entries = [(int(i), e) for i, e in position.items()]
    token, own = entries[0]
    ranked = [(e["rank"], i, e["decoded_token"], e["logprob"]) for i, e in entries if e["rank"]]
    return TokenLogprob(
        token,
        own["decoded_token"],
        float(own["logprob"] or 0.0),
        int(own["rank"] or 0),
        tuple((i, text, float(lp)) for rank, i, text, lp in sorted(ranked) if rank <= top),
    )


class TritonBackend:
    """A long-lived channel to one Triton server; one gRPC stream per generation at a time,
    so that cancelling a generation cancels exactly its request inside Triton. Streams
    whose generation finished are kept open for the next (``WarmStreams``)."""

    def __init__(
        self,
        url: str,
        stream_timeout_s: float,
        max_idle_streams: int = MAX_IDLE_STREAMS,
        gap: StreamGap = StreamGap(),
    ) -> None:
        """``gap``: the engine's stream gap asked of every generation (none: the model's
        own, as any Triton client gets it)."""
        self.url = url
        self._timeout = stream_timeout_s
        self.gap = gap
        self._channel = grpc.aio.insecure_channel(url, options=TRITON_CHANNEL_OPTIONS)
        self._stub: Any = service_pb2_grpc.GRPCInferenceServiceStub(self._channel)
        self._streams: WarmStreams[Any] = WarmStreams(self._stub.ModelStreamInfer, max_idle_streams)
        self._reports_of: dict[str, ModelReports] = {}  # per model, from its metadata

    @property
    def idle_streams(self) -> int:
        return self._streams.idle

    async def close(self) -> None:
        await self._streams.close()
        await self._channel.close()

    async def _connected(self) -> None:
        """A channel still reconnecting to a Triton that is back gets a moment to be ready
        instead of failing the request (the router would count it against this replica);
        with Triton down, the call then fails as it would have."""
        if self._channel.get_state(try_to_connect=True) is grpc.ChannelConnectivity.READY:
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._channel.channel_ready(), RECONNECT_WAIT_S)

    async def generate(self, call: InferenceCall) -> AsyncIterator[Chunk]:
        """Yields text chunks; closing the iterator early cancels the request in Triton."""
        await self._connected()
        reports = await self._reports(call.model)
        _check_reported(call, reports)
        cached = reports is not None and reports.cached_tokens
        stream = await self._start(build_request(call, cached, self.gap))
        first_tokens.start_sent()  # in a router whose endpoint is Triton itself
        deadline = _Deadline(stream, self._timeout)
        ended = False  # Triton sent the generation's last response
        try:
            while not ended:
                reply = await self._next(stream, deadline)
                if reply.error_message:
                    ended = True
                    self._streams.discard(stream)
                    raise _stream_error(reply.error_message, call.model)
                if reply.infer_response.id != call.request_id:
                    continue  # an earlier generation's stray on a reused stream
                chunk = parse_response(reply.infer_response, call.sampling)
                if chunk.finish_reason is not None:
                    # Back before the last yield: a caller may stop at the last chunk.
                    ended = True
                    deadline.cancel()
                    self._streams.put_back(stream)
                yield chunk
        finally:
            deadline.cancel()
            # Cancel only a generation cut short: cancelling a stream Triton has finished
            # leaves it waiting for that stream at shutdown.
            if not ended:
                stream.cancel()

    async def _start(self, request: service_pb2.ModelInferRequest) -> Any:
        """A stream with ``request`` written to it: an idle one if any, a new one if the
        idle one broke meanwhile (its first write fails)."""
        stream, was_idle = self._streams.take()
        try:
            await stream.write(request)
            return stream
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as exc:
            if not was_idle:
                raise _write_error(exc, self.url) from None
        stream = self._stub.ModelStreamInfer()
        try:
            await stream.write(request)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as exc:
            raise _write_error(exc, self.url) from None
        return stream

    async def _reports(self, model: str) -> ModelReports | None:
        """What the model reports beyond the vLLM backend's outputs (its metadata, asked
        once); None while that cannot be known."""
        known = self._reports_of.get(model)
        if known is not None:
            return known
        request = service_pb2.ModelMetadataRequest(name=model)
        try:
            meta = await self._stub.ModelMetadata(request, timeout=5)
        except grpc.aio.AioRpcError:
            return None  # the generation will say what is wrong; ask again next time
        known = ModelReports(
            cached_tokens=any(i.name == CACHED_TOKENS_FLAG for i in meta.inputs),
            prompt_logprobs=any(o.name == PROMPT_LOGPROBS for o in meta.outputs),
            input_ids=any(i.name == INPUT_IDS for i in meta.inputs),
            prompt_token_ids=any(i.name == PROMPT_IDS_FLAG for i in meta.inputs),
        )
        self._reports_of[model] = known
        return known

    async def describe(self, model: str, timeout_s: float = 30.0) -> ModelCard:
        """The model's card, asked of the model itself."""
        await self._connected()  # the first card is often asked just after Triton came up
        stream = self._stub.ModelStreamInfer(timeout=timeout_s)
        answered = False
        try:
            await self._send(stream, build_card_request(model))
            reply = await self._next(stream)
            answered = True
        finally:
            if answered:  # the card is the request's final response: end, never cancel
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(end_stream(stream), CLOSE_WAIT_S)
            else:
                stream.cancel()
        if reply.error_message:
            error = _stream_error(reply.error_message, model)
            if isinstance(error, InvalidArgument) and error.field == "model":
                raise NotFound(error.message)
            raise error
        response = reply.infer_response
        raw = dict(
            zip((o.name for o in response.outputs), response.raw_output_contents, strict=False)
        )
        return parse_card(model, first_bytes_element(raw.get("text_output", b"")).decode())

    async def probe(self, model: str, timeout_s: float) -> None:
        """A request the model's backend must refuse (``max_tokens: 0``): its refusal,
        naming the field, proves the backend process alive and answering, and nothing
        reaches the engine. Unavailable if it fails otherwise or not within ``timeout_s``."""
        call = InferenceCall("liveness-probe", model, "probe", Sampling(max_tokens=0))
        try:
            async with asyncio.timeout(timeout_s):
                async for _ in self.generate(call):
                    break
        except InvalidArgument as err:
            if "max_tokens" in err.field:
                return
            raise Unavailable(f"model '{model}' answered the probe oddly: {err.message}") from None
        except TimeoutError:
            raise Unavailable(f"model '{model}' did not answer in {timeout_s:g} s") from None
        raise Unavailable(f"model '{model}' generated for a probe it must refuse")

    async def reload(self, model: str) -> bool:
        """A new instance of ``model`` (unload, then load: a new backend process); False
        when Triton does not allow it (its model control mode is not ``explicit``)."""
        try:
            await self._stub.RepositoryModelUnload(
                service_pb2.RepositoryModelUnloadRequest(model_name=model), timeout=60
            )
            await self._stub.RepositoryModelLoad(
                service_pb2.RepositoryModelLoadRequest(model_name=model), timeout=300
            )
        except grpc.aio.AioRpcError as exc:
            log.warning(
                "Triton did not reload the model",
                extra={"fields": {"model": model, "code": exc.code().name, "error": exc.details()}},
            )
            return False
        log.info("Triton reloaded the model", extra={"fields": {"model": model}})
        return True

    async def _send(self, stream: Any, request: service_pb2.ModelInferRequest) -> None:
        try:
            await stream.write(request)
            # Half-close: Triton keeps streaming a decoupled model's responses.
            await stream.done_writing()
        except grpc.aio.AioRpcError as exc:
            raise _transport_error(exc, self.url) from None

    async def _next(
        self, stream: Any, deadline: _Deadline | None = None
    ) -> service_pb2.ModelStreamInferResponse:
        try:
            reply = await stream.read()
        except grpc.aio.AioRpcError as exc:
            raise _transport_error(exc, self.url) from None
        except asyncio.CancelledError:
            if deadline is None or not deadline.expired or _task_cancelled():
                raise
            raise Unavailable("Triton did not finish the stream in time") from None
        if reply is grpc.aio.EOF:
            log.warning("Triton ended a stream early", extra={"fields": {"triton": self.url}})
            raise Unavailable("Triton ended the stream before the last response")
        result: service_pb2.ModelStreamInferResponse = reply
        return result


class _Deadline:
    """Cancels a generation's stream once it has run ``seconds`` (the stream outlives a
    generation, so gRPC's per-call deadline cannot be this)."""

    def __init__(self, stream: Any, seconds: float) -> None:
        self.expired = False
        self._handle = asyncio.get_running_loop().call_later(seconds, self._expire, stream)

    def _expire(self, stream: Any) -> None:
        self.expired = True
        stream.cancel()

    def cancel(self) -> None:
        self._handle.cancel()


def _task_cancelled() -> bool:
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def _write_error(exc: Exception, url: str) -> MeshError:
    if isinstance(exc, grpc.aio.AioRpcError):
        return _transport_error(exc, url)
    log.warning("Triton stream ended before the request", extra={"fields": {"triton": url}})
    return TritonUnreachable("Triton is unavailable")


def _transport_error(exc: grpc.aio.AioRpcError, url: str) -> MeshError:
    """The failure as callers may see it: Triton's address and the transport's details
    go to the log only."""
    log.warning(
        "Triton call failed",
        extra={"fields": {"triton": url, "code": exc.code().name, "error": exc.details()}},
    )
    if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
        return Unavailable("Triton did not finish the stream in time")
    return TritonUnreachable("Triton is unavailable")


class TritonUnreachable(EngineUnreachable):
    """Triton itself cannot be reached (not running yet, or gone): an outage of the engine,
    which load reports show (engine_reachable), not a failure of one of its models."""


class ModelInstanceFailed(Unavailable):
    """The model's backend process is gone or broken: Triton cannot run the model here
    until it is loaded again."""


def _stream_error(message: str, model: str) -> MeshError:
    if "Stub process" in message and "is not healthy" in message:
        return ModelInstanceFailed(f"model '{model}' has no working instance here")
    if "unknown model" in message or "is not found" in message:
        return InvalidArgument("model", f"model '{model}' is not served by Triton")
    field, sep, reason = message.partition(": ")
    if sep and re.split(r"[.\[]", field, maxsplit=1)[0] in _FIELDS:
        # The engine's sampling_parameters.x is the mesh's sampling.x, as clients name it.
        field = re.sub(r"^sampling_parameters\.", "sampling.", field)
        return InvalidArgument(_MESH_FIELDS.get(field, field), reason)
    return Unavailable(f"Triton failed the request: {message}")

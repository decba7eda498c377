"""Triton Python-backend adapter for the reference engine (decoupled, vLLM tensor contract).

Inputs:  text_input (BYTES), stream (BOOL), sampling_parameters (BYTES, JSON),
         exclude_input_in_output (BOOL), and vLLM's optional return_* flags (accepted);
         input_ids (INT32, optional: the prompt's token ids, text_input then its text).
Outputs: text_output (BYTES), finish_reason (BYTES; empty until the last response),
         num_output_tokens (UINT32; tokens behind this response's text, as vLLM reports),
         the vLLM backend's optional outputs, num_cached_tokens and prompt_logprobs.
Request parameters: scheduling_priority, cache_salt, stream_gap_ms, stream_gap_after and
         resumed_output_chars (refengine/contract.py), model_card (the model's card instead
         of a generation).
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils
from refengine import Engine, EngineConfig, EngineStats, GenerationRequest, RequestError
from refengine.contract import (
    decode_text,
    parse_cache_salt,
    parse_priority,
    parse_resumed_output,
    parse_sampling_parameters,
    parse_stream_gap,
)
from refengine.families import build_model
from refengine.sequence import Details, logprob_entry

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


# (text, finish reason, tokens, details), or an error message
Payload = tuple[str, str, int, Details | None] | str


class TritonIO:
    """The one thread that talks to Triton: responses, cancellation polls, metrics.

    Every call into Triton (a response send, ``is_cancelled``, a metric update) waits on
    Triton's main process. Made here, off the engine thread, those waits overlap the next
    forward pass; made from one thread only, they never run concurrently with each other.
    While a request's earlier text still waits to be sent, new text for it joins that
    response instead of queueing another one: when many streams share the engine, fewer
    and larger responses keep sending from becoming the bottleneck, and an idle engine
    still sends every token at once.
    """

    def __init__(self, exporter: StatsExporter, poll_interval_s: float = 0.1) -> None:
        self._exporter = exporter
        self._poll_interval = poll_interval_s
        self._pending: OrderedDict[int, tuple[Any, list[tuple[Payload, int]]]] = OrderedDict()
        self._sinks: set[TritonSink] = set()
        self._stats: EngineStats | None = None
        self._ready = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="triton-io", daemon=True)
        self._thread.start()

    def put(self, sender: Any, payload: Payload, flags: int = 0) -> None:
        with self._ready:
            _, items = self._pending.setdefault(id(sender), (sender, []))
            last = items[-1][0] if items else None
            if isinstance(last, tuple) and not last[1] and isinstance(payload, tuple):
                # Unsent text that is not the last response takes the new text along.
                details = last[3].then(payload[3]) if last[3] is not None else payload[3]
                merged = (last[0] + payload[0], payload[1], last[2] + payload[2], details)
                items[-1] = (merged, flags)
            else:
                items.append((payload, flags))
            self._ready.notify()

    def watch(self, sink: TritonSink) -> None:
        with self._ready:
            self._sinks.add(sink)
            self._ready.notify()

    def forget(self, sink: TritonSink) -> None:
        with self._ready:
            self._sinks.discard(sink)

    def publish(self, stats: EngineStats) -> None:
        """Queues the engine's statistics for Triton's /metrics (the engine thread calls it)."""
        with self._ready:
            self._stats = stats
            self._ready.notify()

    def close(self, timeout_s: float = 10.0) -> None:
        with self._ready:
            self._closed = True
            self._ready.notify()
        self._thread.join(timeout_s)
        self._exporter.close()

    def _run(self) -> None:
        next_poll = time.monotonic() + self._poll_interval
        while True:
            with self._ready:
                while not (self._pending or self._stats or self._closed):
                    # Cancellation polls are due only while requests run; with none,
                    # asleep until there is work (``watch`` wakes it).
                    due = max(0.0, next_poll - time.monotonic()) if self._sinks else None
                    if not self._ready.wait(due):
                        break
                if self._closed and not self._pending:
                    return
                item = self._take()
                stats, self._stats = self._stats, None
                poll_due = time.monotonic() >= next_poll
                sinks = list(self._sinks) if poll_due else []
            if stats is not None:  # first: what a response reports has been counted
                self._exporter.publish(stats)
            if item is not None:
                _send(*item)
            if poll_due:
                for sink in sinks:
                    sink.poll_cancelled()
                next_poll = time.monotonic() + self._poll_interval

    def _take(self) -> tuple[Any, Payload, int] | None:
        if not self._pending:
            return None
        key, (sender, items) = self._pending.popitem(last=False)
        payload, flags = items.pop(0)
        if items:  # the request's later responses wait behind the other requests'
            self._pending[key] = (sender, items)
        return sender, payload, flags


def _send(sender: Any, payload: Payload, flags: int) -> None:
    try:
        if isinstance(payload, str):
            error = pb_utils.TritonError(payload)
            sender.send(pb_utils.InferenceResponse(output_tensors=[], error=error), flags=FINAL)
        else:
            sender.send(_response(*payload), flags=flags)
    except Exception as exc:  # e.g. the client went away; other requests go on
        pb_utils.Logger.log_warn(f"sending a response failed: {exc}")


class TritonSink:
    """One request's output, sent through its decoupled response sender by the IO thread."""

    def __init__(self, request: Any, io: TritonIO) -> None:
        self._request = request
        self._sender = request.get_response_sender()
        self._io = io
        self._cancelled = False
        # Triton frees the request once its final response is sent: from the moment that
        # response is queued, nothing may touch the request (the lock orders the two).
        self._lock = threading.Lock()
        self._closed = False
        io.watch(self)

    def poll_cancelled(self) -> None:
        with self._lock:
            if self._closed:
                return
            try:
                self._cancelled = self._cancelled or bool(self._request.is_cancelled())
            except Exception:  # the request is gone; the engine finishes it as cancelled
                self._cancelled = True

    def is_cancelled(self) -> bool:
        return self._cancelled

    def emit(self, text: str, num_tokens: int, details: Details | None = None) -> None:
        self._io.put(self._sender, (text, "", num_tokens, details))

    def finish(
        self, text: str, num_tokens: int, reason: str, details: Details | None = None
    ) -> None:
        self._close()
        self._io.put(self._sender, (text, reason, num_tokens, details), FINAL)

    def fail(self, message: str) -> None:
        self._close()
        self._io.put(self._sender, message, FINAL)

    def _close(self) -> None:
        with self._lock:
            self._closed = True
        self._io.forget(self)


# Engine statistics as Triton custom metrics: name -> (help, value of EngineStats).
COUNTERS: dict[str, tuple[str, Callable[[EngineStats], float]]] = {
    "llm_engine_prompt_tokens_total": ("Prompt tokens admitted", lambda s: s.prompt_tokens),
    "llm_engine_prefix_cache_hit_tokens_total": (
        "Prompt tokens read from the prefix cache",
        lambda s: s.prefix_hit_tokens,
    ),
    "llm_engine_prefill_tokens_total": (
        "Tokens computed in prefill (recomputation included)",
        lambda s: s.prefill_tokens,
    ),
    "llm_engine_generation_tokens_total": ("Tokens generated", lambda s: s.generation_tokens),
    "llm_engine_preemptions_total": ("Sequences preempted", lambda s: s.preemptions),
    "llm_engine_preempted_seconds_total": (
        "Time preempted sequences spent out of the batch",
        lambda s: s.preempted_seconds,
    ),
    "llm_engine_recomputed_tokens_total": (
        "Tokens computed again after a preemption",
        lambda s: s.recomputed_tokens,
    ),
    "llm_engine_steps_total": ("Engine steps run", lambda s: s.steps),
    "llm_engine_step_seconds_total": ("Time in engine steps", lambda s: s.step_seconds),
    "llm_engine_first_word_steps_total": (
        "Steps that left less urgent work out for a more urgent sequence's first word",
        lambda s: s.first_word_steps,
    ),
    "llm_engine_first_word_step_seconds_total": (
        "Time in steps that left less urgent work out for a first word",
        lambda s: s.first_word_step_seconds,
    ),
}
GAUGES: dict[str, tuple[str, Callable[[EngineStats], float]]] = {
    "llm_engine_running_sequences": ("Sequences being generated", lambda s: s.running),
    "llm_engine_waiting_sequences": ("Sequences queued", lambda s: s.waiting),
    "llm_engine_max_running_sequences": (
        "Sequences the engine runs at once",
        lambda s: s.max_running,
    ),
    "llm_engine_kv_blocks_used": ("KV cache blocks in use", lambda s: s.kv_blocks_used),
    "llm_engine_kv_blocks_total": ("KV cache blocks", lambda s: s.kv_blocks_total),
    # What an autoscaler scales on: queue depth, and this (no ratio of two series needed).
    "llm_engine_kv_utilization": (
        "Share of KV cache blocks in use",
        lambda s: s.kv_blocks_used / s.kv_blocks_total if s.kv_blocks_total else 0.0,
    ),
    "llm_engine_prefix_cache_hit_rate": (
        "Share of prompt tokens read from the prefix cache",
        lambda s: s.prefix_hit_rate,
    ),
}
FINISH_REASONS = ("length", "stop", "cancelled", "error")


class StatsExporter:
    """Mirrors the engine's statistics into Triton's /metrics (custom metric families)."""

    def __init__(self, model_name: str) -> None:
        labels = {"model": model_name}
        counter, gauge = pb_utils.MetricFamily.COUNTER, pb_utils.MetricFamily.GAUGE
        # Triton requires each MetricFamily to outlive its Metrics: keep them all.
        self._families: list[Any] = []
        self._counters = {
            name: (self._family(name, text, counter).Metric(labels=labels), value)
            for name, (text, value) in COUNTERS.items()
        }
        self._gauges = {
            name: (self._family(name, text, gauge).Metric(labels=labels), value)
            for name, (text, value) in GAUGES.items()
        }
        finished = self._family(
            "llm_engine_requests_finished_total", "Requests finished, by finish reason", counter
        )
        self._finished = {
            reason: finished.Metric(labels={**labels, "reason": reason})
            for reason in FINISH_REASONS
        }
        self._labels = labels
        self._displaced = self._family(
            "llm_engine_priority_preemptions_total",
            "Sequences preempted for more urgent ones, by their scheduling priority",
            counter,
        )
        self._by_priority: dict[int, Any] = {}  # a metric per priority, as they appear
        self._queued = self._family(
            "llm_engine_waiting_sequences_by_priority",
            "Sequences queued, by their scheduling priority",
            gauge,
        )
        self._queued_by_priority: dict[int, Any] = {}  # the same
        self._published: dict[str, float] = {}

    def close(self) -> None:
        """Drops every Metric before its MetricFamily, as the Python backend requires (in
        the reverse order, the stub crashes while the interpreter shuts down)."""
        self._counters.clear()
        self._gauges.clear()
        self._finished.clear()
        self._by_priority.clear()
        self._queued_by_priority.clear()
        self._families.clear()

    def _family(self, name: str, description: str, kind: Any) -> Any:
        family = pb_utils.MetricFamily(name=name, description=description, kind=kind)
        self._families.append(family)
        return family

    def publish(self, stats: EngineStats) -> None:
        """Best effort: a metrics failure must never fail a request."""
        try:
            for name, (metric, value) in self._counters.items():
                self._add(name, metric, value(stats))
            for reason, metric in self._finished.items():
                self._add(reason, metric, stats.finished[reason])
            for priority, count in stats.preemptions_by_priority.items():
                metric = self._of_priority(self._by_priority, self._displaced, priority)
                self._add(f"priority {priority}", metric, count)
            for name, (metric, value) in self._gauges.items():
                self._set(name, metric, value(stats))
            for priority in stats.waiting_by_priority.keys() - self._queued_by_priority.keys():
                self._of_priority(self._queued_by_priority, self._queued, priority)
            for priority, metric in self._queued_by_priority.items():  # 0 once none waits
                self._set(f"waiting {priority}", metric, stats.waiting_by_priority[priority])
        except Exception as exc:
            pb_utils.Logger.log_warn(f"publishing engine metrics failed: {exc}")

    def _of_priority(self, metrics: dict[int, Any], family: Any, priority: int) -> Any:
        metric = metrics.get(priority)
        if metric is None:
            labels = {**self._labels, "priority": str(priority)}
            metric = metrics[priority] = family.Metric(labels=labels)
        return metric

    def _set(self, key: str, metric: Any, value: float) -> None:
        """Only a changed value: each update is a round trip to Triton's process, and a
        request's end publishes."""
        if self._published.get(key) != value:
            metric.set(value)
            self._published[key] = value

    def _add(self, key: str, metric: Any, total: float) -> None:
        delta = total - self._published.get(key, 0)
        if delta > 0:
            metric.increment(delta)
            self._published[key] = total


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        _limit_blas_threads(int(params.get("blas_threads", 1)))
        built = build_model(params)  # a bad model file fails the load, named
        self.card = json.dumps(asdict(built.card))
        self.io = TritonIO(StatsExporter(args["model_name"]))
        config = EngineConfig.from_parameters(params)
        self.engine = Engine(built.model, built.tokenizer, config, on_stats=self.io.publish)
        self.io.publish(self.engine.stats)
        self.engine.start()

    def execute(self, requests: list[Any]) -> None:
        for request in requests:
            sink = TritonSink(request, self.io)
            if _asks_for_card(request):
                sink.finish(self.card, 0, "stop")
                continue
            try:
                self.engine.submit(_parse(request), sink)
            except RequestError as exc:
                sink.fail(str(exc))
            except Exception as exc:  # execute must not raise once requests are accepted
                sink.fail(f"invalid request: {exc}")

    def finalize(self) -> None:
        self.engine.stop()
        self.io.close()


def _limit_blas_threads(threads: int) -> None:
    """Decode steps are small matrix products: extra BLAS threads only contend for cores
    that the serving stack needs. threadpoolctl is optional in the backend's environment."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        pb_utils.Logger.log_warn("threadpoolctl is not installed; BLAS threads are not limited")
        return
    threadpool_limits(limits=threads, user_api="blas")


def _parse(request: Any) -> GenerationRequest:
    prompt = _scalar(request, "text_input")
    if prompt is None:
        raise RequestError("text_input: required")
    parameters = _parameters(request)
    text = decode_text(prompt, "text_input")
    return GenerationRequest(
        prompt_ids=_ids(request, "input_ids"),
        priority=parse_priority(parameters),
        cache_salt=parse_cache_salt(parameters),
        stream_gap=parse_stream_gap(parameters),
        resumed_output_chars=parse_resumed_output(parameters, text),
        prompt=text,
        stream=_flag(request, "stream"),
        exclude_input_in_output=_flag(request, "exclude_input_in_output"),
        sampling=parse_sampling_parameters(_scalar(request, "sampling_parameters")),
        return_logprobs=_flag(request, "return_logprobs"),
        return_cumulative_logprob=_flag(request, "return_cumulative_logprob"),
        return_num_input_tokens=_flag(request, "return_num_input_tokens"),
        return_num_cached_tokens=_flag(request, "return_num_cached_tokens"),
        return_prompt_token_ids=_flag(request, "return_prompt_token_ids"),
    )


def _ids(request: Any, name: str) -> tuple[int, ...] | None:
    """An optional tensor of token ids, as ints (None when absent)."""
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return None
    ids = tuple(int(i) for i in tensor.as_numpy().reshape(-1))
    if not ids:
        raise RequestError(f"{name}: no token ids")
    return ids


def _flag(request: Any, name: str) -> bool:
    value = _scalar(request, name)
    return bool(value) if value is not None else False


def _asks_for_card(request: Any) -> bool:
    """A request with the parameter ``model_card: true`` is answered with the model card
    (JSON, in text_output) instead of a generation: how the mesh learns the model's
    tokenizer and chat template from the model itself."""
    parameters = _parameters(request)
    return isinstance(parameters, dict) and parameters.get("model_card") is True


def _parameters(request: Any) -> object:
    """The request's parameters (a JSON object), {} when it has none or they do not parse."""
    try:
        return json.loads(request.parameters() or "{}")
    except (AttributeError, TypeError, ValueError):
        return {}


def _scalar(request: Any, name: str) -> Any:
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return None
    values = tensor.as_numpy().reshape(-1)
    if values.size != 1:
        raise RequestError(f"{name}: expected one element, got {values.size}")
    return values[0]


def _response(text: str, finish_reason: str, num_tokens: int, details: Details | None) -> Any:
    tensors = [
        pb_utils.Tensor("text_output", np.array([text.encode("utf-8")], dtype=np.object_)),
        pb_utils.Tensor("finish_reason", np.array([finish_reason.encode()], dtype=np.object_)),
        pb_utils.Tensor("num_output_tokens", np.array([num_tokens], dtype=np.uint32)),
    ]
    if details is not None:
        tensors += _detail_tensors(details)
    return pb_utils.InferenceResponse(output_tensors=tensors)


def _detail_tensors(details: Details) -> list[Any]:
    """The vLLM backend's optional outputs: ``logprobs`` as JSON, one entry per token of
    this response ({token id: {logprob, rank, decoded_token}}, the sampled token and the
    most likely ones), ``cumulative_logprob``, ``num_input_tokens``; and the engine's
    ``num_cached_tokens``, ``prompt_logprobs`` (first response; an entry per prompt
    token, as ``logprobs``'s, when sampling_parameters has vLLM's prompt_logprobs) and
    ``prompt_token_ids`` (first response, with ``return_prompt_token_ids``)."""
    tensors = []
    if details.logprobs is not None:
        entries = [logprob_entry(t) for t in details.logprobs]
        raw = json.dumps(entries, ensure_ascii=False).encode("utf-8")
        tensors.append(pb_utils.Tensor("logprobs", np.array([raw], dtype=np.object_)))
    if details.cumulative_logprob is not None:
        value = np.array([details.cumulative_logprob], dtype=np.float32)
        tensors.append(pb_utils.Tensor("cumulative_logprob", value))
    if details.num_input_tokens is not None:
        value = np.array([details.num_input_tokens], dtype=np.uint32)
        tensors.append(pb_utils.Tensor("num_input_tokens", value))
    if details.num_cached_tokens is not None:
        value = np.array([details.num_cached_tokens], dtype=np.uint32)
        tensors.append(pb_utils.Tensor("num_cached_tokens", value))
    if details.prompt_logprobs is not None:
        entries = [logprob_entry(t) for t in details.prompt_logprobs]
        raw = json.dumps(entries, ensure_ascii=False).encode("utf-8")
        tensors.append(pb_utils.Tensor("prompt_logprobs", np.array([raw], dtype=np.object_)))
    if details.prompt_token_ids is not None:
        ids = np.array(details.prompt_token_ids, dtype=np.int32)
        tensors.append(pb_utils.Tensor("prompt_token_ids", ids))
    return tensors

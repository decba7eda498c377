"""The generation loop: admits requests, runs prefill and decode steps, streams text out.

This engine runs one sequence at a time on its own thread: ``submit`` only enqueues, so
Triton's decoupled ``execute`` returns at once and requests wait their turn in FIFO order.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from refengine.contract import GenerationRequest, RequestError
from refengine.sampling import Sampler
from refengine.stops import StopMatcher
from refengine.tokenizer import EOS, ByteTokenizer, StreamDecoder
from refengine.transformer import Transformer

log = logging.getLogger(__name__)

LENGTH, STOP, CANCELLED = "length", "stop", "cancelled"
# Asking Triton whether a request was cancelled is an IPC round trip; do it at most this often.
CANCEL_CHECK_INTERVAL_S = 0.025


class Sink(Protocol):
    """Where one request's output goes (a Triton response sender, or a test double)."""

    def is_cancelled(self) -> bool: ...

    def emit(self, text: str, num_tokens: int) -> None:
        """A streamed delta: ``num_tokens`` new tokens produced ``text``."""

    def finish(self, text: str, num_tokens: int, reason: str) -> None:
        """The last response of the request."""

    def fail(self, message: str) -> None:
        """The request failed; ``message`` is safe to show the client."""


@dataclass
class EngineStats:
    running: int = 0
    waiting: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: Counter[str] = field(default_factory=Counter)


@dataclass
class _Sequence:
    request: GenerationRequest
    prompt_ids: list[int]
    sink: Sink
    enqueued_at: float = field(default_factory=time.monotonic)


class Engine:
    def __init__(
        self,
        model: Transformer,
        tokenizer: ByteTokenizer | None = None,
        on_stats: Callable[[EngineStats], None] | None = None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer or ByteTokenizer()
        self.stats = EngineStats()
        # Called (on the engine thread or the submitter's) after every change of ``stats``.
        self._on_stats = on_stats or (lambda _: None)
        self._queue: queue.Queue[_Sequence | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(self, request: GenerationRequest, sink: Sink) -> None:
        """Validates and enqueues a request; raises RequestError if it cannot be served."""
        prompt_ids = self.tokenizer.encode(request.prompt)
        limit = self.model.shape.max_context
        if len(prompt_ids) >= limit:
            raise RequestError(
                f"text_input: prompt is {len(prompt_ids)} tokens; the model's context is {limit}"
            )
        with self._lock:
            self.stats.waiting += 1
        self._queue.put(_Sequence(request, prompt_ids, sink))
        self._on_stats(self.stats)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="refengine", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stops after the running sequence; waiting ones are finished as cancelled."""
        self._queue.put(None)
        if self._thread is not None:
            self._thread.join(timeout_s)
        while True:
            try:
                seq = self._queue.get_nowait()
            except queue.Empty:
                return
            if seq is not None:
                seq.sink.finish("", 0, CANCELLED)

    def _loop(self) -> None:
        while (seq := self._queue.get()) is not None:
            with self._lock:
                self.stats.waiting -= 1
                self.stats.running += 1
            reason = self._run_guarded(seq)
            with self._lock:
                self.stats.running -= 1
                self.stats.finished[reason] += 1
            self._on_stats(self.stats)

    def _run_guarded(self, seq: _Sequence) -> str:
        """Runs one sequence; whatever happens, the engine thread lives on."""
        try:
            return self._run(seq)
        except Exception as exc:
            log.exception("generation failed")
            try:
                seq.sink.fail(f"generation failed: {exc}")
            except Exception:
                log.exception("could not report the failure to the client")
            return "error"

    def _run(self, seq: _Sequence) -> str:
        params = seq.request.sampling
        stream = seq.request.stream
        if seq.sink.is_cancelled():
            seq.sink.finish("", 0, CANCELLED)
            return CANCELLED
        cache = self.model.new_cache(len(seq.prompt_ids) + params.max_tokens)
        sampler = Sampler(params)
        decoder, stops = StreamDecoder(), StopMatcher(params.stop)
        logits = self.model.forward(seq.prompt_ids, cache)
        self.stats.prompt_tokens += len(seq.prompt_ids)
        # Prompt plus output never exceeds the model's context (as vLLM's max_model_len).
        limit = min(params.max_tokens, self.model.shape.max_context - len(seq.prompt_ids))
        produced, unsent_tokens, text_out = 0, 0, []
        reason = LENGTH
        next_cancel_check = 0.0
        while True:
            if time.monotonic() >= next_cancel_check:
                if seq.sink.is_cancelled():
                    reason = CANCELLED
                    break
                next_cancel_check = time.monotonic() + CANCEL_CHECK_INTERVAL_S
            token = sampler.sample(logits)
            produced += 1
            unsent_tokens += 1
            self.stats.generation_tokens += 1
            if token == EOS:
                reason = STOP
                break
            released = stops.push(decoder.push(token))
            if stops.stopped:
                reason = STOP
            if released:
                text_out.append(released)
                if stream:
                    seq.sink.emit(released, unsent_tokens)
                    unsent_tokens = 0
            if stops.stopped or produced >= limit:
                break
            logits = self.model.forward([token], cache)
        tail = "" if stops.stopped else stops.push(decoder.flush()) + stops.flush()
        if stream:
            seq.sink.finish(tail, unsent_tokens, reason)
        else:
            prefix = "" if seq.request.exclude_input_in_output else seq.request.prompt
            seq.sink.finish(prefix + "".join(text_out) + tail, produced, reason)
        return reason

"""The engine: continuous (iteration-level) batching over a paged KV cache.

``submit`` only enqueues, so Triton's decoupled ``execute`` returns at once. The engine
thread then runs steps: each step admits waiting sequences (most urgent priority first,
then in arrival order, while KV blocks, running slots and the token budget allow, reusing
cached prefix blocks), runs one batched forward pass for the prefill of the newly admitted
and the next token of every running sequence, samples, streams text, and retires finished
sequences. Preemption frees a running sequence's blocks and puts it back in the queue, to
be recomputed (its prefix-cached blocks mostly read back): when a running sequence needs
a block and none is left (the least urgent, newest sequence goes), and, as vLLM's
priority scheduling does, when the queue's most urgent sequence cannot be admitted and a
less urgent one runs (unless that one was preempted ``max_preemptions`` times already,
the bound on its starvation). No sequence is lost or duplicated; its client sees a pause.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import numpy.typing as npt

from refengine.attention import Segment
from refengine.contract import GenerationRequest, RequestError, SamplingParams
from refengine.kvcache import BlockPool, block_hash
from refengine.prompt_scores import logit_rows, score_prompts
from refengine.sampling import OutputMasks, sample_batch, score_token
from refengine.sequence import CANCELLED, ERROR, LENGTH, STOP, Sequence, Sink, TokenLogprob
from refengine.structured import Grammars
from refengine.tokenizer import ByteTokenizer, Tokenizer

log = logging.getLogger(__name__)

# Asking Triton whether a request was cancelled is an IPC round trip; do it at most this
# often per sequence.
CANCEL_CHECK_INTERVAL_S = 0.025
# A generation whose structure no token the model may write continues (its control tokens
# are never written; bad words and allowed tokens take others away): the request's fault.
STRUCTURE_FIELD = "sampling_parameters.structured_outputs"
STRUCTURE_DEAD_END = (
    f"{STRUCTURE_FIELD}: no token the model may write continues the output within it"
)
MAX_GRAMMAR_REASON = 160  # characters of the grammar's own account of a failure
# Statistics are published at least this often while busy (load reports read them).
STATS_INTERVAL_S = 0.05
IDLE_RECHECK_S = 0.05
AUTO_STREAM_DIVISOR = 4


class ModelShape(Protocol):
    """What the engine sizes its KV cache and checks prompts with."""

    @property
    def n_layers(self) -> int: ...
    @property
    def n_kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def max_context(self) -> int: ...


class LanguageModel(Protocol):
    """A model family's forward pass over the paged KV cache (transformer.py, llama.py)."""

    @property
    def shape(self) -> ModelShape: ...

    def forward(
        self, segments: list[Segment], pool: BlockPool, rows: npt.NDArray[np.intp] | None = None
    ) -> npt.NDArray[np.float32]:
        """Next-token logits of each segment, [segments, vocab]; with ``rows``, those after
        each of these of the step's tokens (rows of the segments' tokens in order)."""


@dataclass(frozen=True)
class EngineConfig:
    kv_blocks: int = 2048
    block_size: int = 16
    max_running: int = 32  # sequences in one step
    max_batched_tokens: int = 2048  # prefill and decode tokens in one step
    # Tokens per streamed response after the first; 0 = one per AUTO_STREAM_DIVISOR
    # running sequences (1 when few run, so a lone stream gets every token at once).
    stream_interval: int = 0
    # A later response goes out at least this long after the sequence's previous one (0:
    # no floor); text held meanwhile goes with the next. An engine faster than that per
    # token sends a lone stream several tokens per response, and every hop after it one
    # message for them; the first response never waits.
    stream_gap_ms: int = 0
    max_logprobs: int = 20  # most likely tokens a request may ask for per position (OpenAI's cap)
    # A prompt's log probabilities go out in one response: at most this many entries
    # (prompt tokens x (1 + the likeliest asked for each)), about 80 bytes of JSON each
    # (a long token text, 200), so that the response stays within gRPC's default 4 MiB.
    max_prompt_logprob_entries: int = 16_384
    # A sequence preempted this many times for more urgent ones is not preempted for them
    # again (memory pressure may still preempt it: nothing else could run otherwise).
    max_preemptions: int = 4
    # A sequence's tokens until its first word has ended (a space after it), at most
    # this many, are computed in steps that leave out the work of less urgent ones: its
    # first words come as on an idle engine (a streamed output check releases a word once
    # the character after it shows), and theirs pause that many steps (1: only the step
    # that prefills it; 0: off).
    urgent_first_tokens: int = 1
    # While more urgent sequences run, a step computes at most this many prompt tokens
    # (first or recomputed) of less urgent ones (0: no bound): a step's time grows with its
    # prompt tokens, and the next urgent arrival waits for the step in progress.
    lower_prefill_tokens: int = 0

    @classmethod
    def from_parameters(cls, params: Mapping[str, str]) -> EngineConfig:
        """From the model's config.pbtxt parameters; an absent one keeps its default."""
        names = {
            "kv_blocks": "kv_blocks",
            "kv_block_size": "block_size",
            "max_running": "max_running",
            "max_batched_tokens": "max_batched_tokens",
            "stream_interval": "stream_interval",
            "stream_gap_ms": "stream_gap_ms",
            "max_logprobs": "max_logprobs",
            "max_prompt_logprob_entries": "max_prompt_logprob_entries",
            "max_preemptions": "max_preemptions",
            "urgent_first_tokens": "urgent_first_tokens",
            "lower_prefill_tokens": "lower_prefill_tokens",
        }
        return cls(**{field: int(params[key]) for key, field in names.items() if key in params})


@dataclass
class EngineStats:
    running: int = 0
    waiting: int = 0
    # The same, by scheduling priority: a router reads whether work as urgent as its next
    # request's queues here (less urgent waiting work it would run ahead of, or preempt).
    waiting_by_priority: Counter[int] = field(default_factory=Counter)
    max_running: int = 0  # the running limit: a router sizes its window to the fleet's
    kv_blocks_total: int = 0
    kv_blocks_used: int = 0
    prompt_tokens: int = 0  # prompt tokens admitted (cached or computed)
    prefix_hit_tokens: int = 0  # of those, read from the prefix cache
    prefill_tokens: int = 0  # tokens computed in prefill (recomputation included)
    generation_tokens: int = 0
    preemptions: int = 0
    preemptions_by_priority: Counter[int] = field(default_factory=Counter)
    preempted_seconds: float = 0.0  # time preempted sequences spent out of the batch
    recomputed_tokens: int = 0  # tokens computed again after a preemption
    steps: int = 0  # steps run: generated tokens per step is the batch a step samples
    step_seconds: float = 0.0  # time in steps (forward pass, sampling, responses)
    # Of those, the steps that left less urgent work out for a first word, and their time
    # (the urgent work in them included: not what they cost the batch, which is read from
    # the tokens generated per second of steps against a run without priorities).
    first_word_steps: int = 0
    first_word_step_seconds: float = 0.0
    finished: Counter[str] = field(default_factory=Counter)

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class Engine:
    def __init__(
        self,
        model: LanguageModel,
        tokenizer: Tokenizer | None = None,
        config: EngineConfig | None = None,
        on_stats: Callable[[EngineStats], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``clock``: when responses go out (``stream_gap_ms``)."""
        self.model = model
        self._clock = clock
        self.tokenizer = tokenizer or ByteTokenizer()
        self._masks = OutputMasks(self.tokenizer)
        self._grammars = Grammars(self.tokenizer, self.tokenizer.output_mask())
        self.config = config or EngineConfig()
        shape = model.shape
        self.pool = BlockPool(
            self.config.kv_blocks,
            self.config.block_size,
            shape.n_layers,
            shape.n_kv_heads,
            shape.head_dim,
        )
        self.stats = EngineStats(
            max_running=self.config.max_running, kv_blocks_total=self.config.kv_blocks
        )
        self._on_stats = on_stats or (lambda _: None)
        self._incoming: queue.SimpleQueue[Sequence] = queue.SimpleQueue()
        self._waiting: list[Sequence] = []  # by Sequence.queue_key
        self._arrivals = itertools.count()
        self._running: list[Sequence] = []
        self._wake = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._published_at = 0.0
        self._for_first_word = False  # this step leaves work out for a first word

    def submit(self, request: GenerationRequest, sink: Sink) -> None:
        """Validates and enqueues a request; raises RequestError if it can never be served."""
        for name in ("logprobs", "prompt_logprobs"):
            wanted = getattr(request.sampling, name)
            if wanted is not None and wanted > self.config.max_logprobs:
                raise RequestError(
                    f"sampling_parameters.{name}: at most {self.config.max_logprobs}, got {wanted}"
                )
        vocab = self.tokenizer.vocab_size
        sampling = request.sampling
        for name, tokens in (
            ("logit_bias", [token for token, _ in sampling.logit_bias]),
            ("stop_token_ids", sampling.stop_token_ids),
            ("allowed_token_ids", sampling.allowed_token_ids),
        ):
            for token in tokens:
                if token >= vocab:
                    raise RequestError(
                        f"sampling_parameters.{name}: {token} is not a token (0-{vocab - 1})"
                    )
        self._check_allowed(sampling)
        prompt = self._prompt_tokens(request)
        context = self.model.shape.max_context
        if len(prompt) >= context:
            raise RequestError(
                f"text_input: prompt is {len(prompt)} tokens; the model's context is {context}"
            )
        self._check_prompt_entries(request, len(prompt))
        max_new = min(request.sampling.max_tokens, context - len(prompt))
        structured = request.sampling.structured
        blocks = -(-(len(prompt) + max_new) // self.pool.block_size)
        if blocks > self.pool.num_blocks:
            raise RequestError(
                f"text_input: prompt and max_tokens need {blocks} KV blocks; "
                f"the cache has {self.pool.num_blocks}"
            )
        sequence = Sequence(
            request,
            sink,
            prompt,
            len(prompt),
            max_new,
            self.tokenizer.stream_decoder(),
            self._masks,
            resumed_output_tokens=self._resumed_output_tokens(request, len(prompt)),
            constraint=self._grammars.matcher(structured) if structured else None,
            banned=self._bad_word_tokens(request.sampling.bad_words),
        )
        if request.sampling.prompt_logprobs is not None and request.prompt_ids is None:
            sequence.prompt_from = len(prompt) - self.tokenizer.count(request.prompt)
        sequence.order = next(self._arrivals)
        self._incoming.put(sequence)
        self._wake.set()

    def _check_allowed(self, sampling: SamplingParams) -> None:
        """RequestError unless some allowed token may come at every step (before
        min_tokens too, when the end of sequence and stop tokens may not)."""
        allowed = list(sampling.allowed_token_ids)
        masks = [self._masks.of(sampling), self._masks.early(sampling)]
        if allowed and any(m is not None and np.isneginf(m[allowed]).all() for m in masks):
            raise RequestError(
                "sampling_parameters.allowed_token_ids: none of them is a token the output "
                "may have (before min_tokens: but for the end and stop tokens)"
            )

    def _bad_word_tokens(self, words: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
        """Each bad word's tokens as the model would write it, alone and after a space when
        that is the same number of tokens with another first one (vLLM's rule)."""
        bos = len(self.tokenizer.encode(""))
        found: list[tuple[int, ...]] = []
        for word in words:
            alone = tuple(self.tokenizer.encode(word.lstrip())[bos:])
            spaced = tuple(self.tokenizer.encode(" " + word.lstrip())[bos:])
            found.append(alone)
            if len(spaced) == len(alone) and spaced[0] != alone[0]:
                found.append(spaced)
        return tuple(found)

    def _prompt_tokens(self, request: GenerationRequest) -> list[int]:
        """The prompt's tokens: its ids as given, or its text's (BOS first where the
        model expects one)."""
        if request.prompt_ids is None:
            return self.tokenizer.encode(request.prompt)
        vocab = self.tokenizer.vocab_size
        for index, token in enumerate(request.prompt_ids):
            if not 0 <= token < vocab:
                raise RequestError(f"input_ids[{index}]: {token} is not a token (0-{vocab - 1})")
        return list(request.prompt_ids)

    def _check_prompt_entries(self, request: GenerationRequest, prompt_tokens: int) -> None:
        top = request.sampling.prompt_logprobs
        limit = self.config.max_prompt_logprob_entries
        if top is not None and prompt_tokens * (1 + top) > limit:
            raise RequestError(
                f"sampling_parameters.prompt_logprobs: {prompt_tokens} prompt tokens x "
                f"{1 + top} entries each is past {limit}; ask for fewer likeliest tokens"
            )

    def _resumed_output_tokens(self, request: GenerationRequest, prompt_tokens: int) -> int:
        """The tokens of the prompt's last ``resumed_output_chars`` characters (only
        penalties, a structured output's grammar and a seeded draw read them)."""
        chars, sampling = request.resumed_output_chars, request.sampling
        if not chars or not (sampling.penalized or sampling.structured or sampling.seeded):
            return 0
        return min(self.tokenizer.count(request.prompt[-chars:]), prompt_tokens)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="refengine", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stops the loop; unfinished requests end as cancelled."""
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        self._take_incoming()
        for seq in [*self._running, *self._waiting]:
            self._finish(seq, CANCELLED)

    def step(self) -> bool:
        """Runs one iteration; returns whether there was anything to do."""
        self._take_incoming()
        self._drop_cancelled()
        batch = self._schedule()
        if batch:
            started = time.monotonic()
            self._run(batch)
            self._send_due()
            self._count_step(time.monotonic() - started)
        self._publish(force=not batch)
        return bool(batch)

    def _count_step(self, seconds: float) -> None:
        self.stats.steps += 1
        self.stats.step_seconds += seconds
        if self._for_first_word:
            self.stats.first_word_steps += 1
            self.stats.first_word_step_seconds += seconds

    def _loop(self) -> None:
        while not self._stopping:
            try:
                busy = self.step()
            except Exception:  # the loop must outlive any bug in one step
                log.exception("engine step failed")
                busy = False
            if not busy:
                # Idle: asleep until a request (or stop) comes. Sequences that cannot run
                # yet are looked at again soon (a cancellation, room that frees up).
                self._wake.wait(IDLE_RECHECK_S if self._running or self._waiting else None)
                self._wake.clear()

    def _take_incoming(self) -> None:
        while True:
            try:
                self._enqueue(self._incoming.get_nowait())
            except queue.Empty:
                return

    def _enqueue(self, seq: Sequence) -> None:
        bisect.insort(self._waiting, seq, key=lambda s: s.queue_key)

    def _drop_cancelled(self) -> None:
        now = time.monotonic()
        for seq in [*self._running, *self._waiting]:
            if now < seq.next_cancel_check:
                continue
            seq.next_cancel_check = now + CANCEL_CHECK_INTERVAL_S
            if seq.sink.is_cancelled():
                self._finish(seq, CANCELLED)

    # -- scheduling ---------------------------------------------------------------------

    def _schedule(self) -> list[tuple[Sequence, int]]:
        """This step's sequences and how many of their pending tokens each computes.

        Chunked prefill: the step's token budget goes first to every decoding sequence
        (one token each), then to prompts being prefilled, oldest first, a chunk each; a
        long prompt spreads over several steps instead of stalling every stream behind it.
        """
        budget = self.config.max_batched_tokens
        decoding: list[Sequence] = []
        prefilling: list[Sequence] = []
        for seq in list(self._running):
            if seq in self._running and self._grow(seq):
                (decoding if len(seq.pending) == 1 else prefilling).append(seq)
        batch = [(seq, 1) for seq in decoding]
        budget -= len(batch)
        for seq in prefilling:
            if budget <= 0:
                break
            batch.append((seq, min(len(seq.pending), budget)))
            budget -= batch[-1][1]
        while self._waiting:
            seq = self._waiting[0]
            room = len(self._running) < self.config.max_running and budget > 0
            if not (room and self._admit(seq)):
                victim = self._displaceable(seq)
                if victim is None:
                    break
                budget += self._take_out(victim, batch)
                continue
            self._waiting.pop(0)
            self._running.append(seq)
            batch.append((seq, min(len(seq.pending), budget)))
            budget -= batch[-1][1]
        bounded = self._bound_lower_prefill(batch)
        step = self._urgent_first(bounded)
        self._for_first_word = len(step) < len(bounded)
        return step

    def _bound_lower_prefill(self, batch: list[tuple[Sequence, int]]) -> list[tuple[Sequence, int]]:
        """The step with at most ``lower_prefill_tokens`` prompt tokens of sequences less
        urgent than the most urgent running one; the rest wait for later steps (chunked
        prefill resumes where a step left off)."""
        left = self.config.lower_prefill_tokens
        if not left or not self._running:
            return batch
        top = min(seq.priority for seq in self._running)
        bounded: list[tuple[Sequence, int]] = []
        for seq, n in batch:
            if seq.priority > top and len(seq.pending) > 1:
                chunk = min(n, left)
                left -= chunk
                if chunk:
                    bounded.append((seq, chunk))
            else:
                bounded.append((seq, n))
        return bounded

    def _urgent_first(self, batch: list[tuple[Sequence, int]]) -> list[tuple[Sequence, int]]:
        """The step without the work of sequences less urgent than one still computing its
        first word (prompt included; at most ``urgent_first_tokens`` tokens), their decodes
        and their (re)computation alike: first words are the most waited-for there are.
        While it leaves that work out, it leaves out its equals' decodes too: a step's time
        grows with every sequence in it, and an equal already streaming loses a step's
        pause, where the less urgent lose the step's whole time. A batch of one priority
        is left as it is (nothing in it waits for a more urgent first word), and so is a
        step while sequences as urgent wait for room: their tier then needs the batch's
        throughput more than one of its first words needs a short step."""
        first = self.config.urgent_first_tokens
        starting = [seq.priority for seq, _ in batch if seq.starting(first)]
        if not starting:
            return batch
        urgent = min(starting)
        if all(seq.priority <= urgent for seq, _ in batch) or self._queued_at(urgent):
            return batch
        return [
            (seq, n)
            for seq, n in batch
            if seq.priority < urgent or (seq.priority == urgent and seq.starting(first))
        ]

    def _queued_at(self, priority: int) -> bool:
        """Whether a sequence of ``priority`` or more urgent waits (the queue is sorted)."""
        return bool(self._waiting) and self._waiting[0].priority <= priority

    def _displaceable(self, urgent: Sequence) -> Sequence | None:
        """The running sequence ``urgent`` may preempt: the least urgent of those less
        urgent than it, not preempted too often already; among equals one whose client
        has its first token already (a pause mid-stream costs it less than a first token
        put off), then the newest."""
        less = [
            s
            for s in self._running
            if s.priority > urgent.priority and s.preemptions < self.config.max_preemptions
        ]
        return max(less, key=lambda s: (s.priority, s.generated > 0, s.order), default=None)

    def _take_out(self, victim: Sequence, batch: list[tuple[Sequence, int]]) -> int:
        """Preempts ``victim`` for a more urgent sequence; the tokens it had in this
        step's batch, given back to the step's budget."""
        given_back = sum(n for seq, n in batch if seq is victim)
        batch[:] = [(seq, n) for seq, n in batch if seq is not victim]
        self._preempt(victim)
        self.stats.preemptions_by_priority[victim.priority] += 1
        return given_back

    def _grow(self, seq: Sequence) -> bool:
        """Gives a running sequence the blocks its next token needs, preempting the newest
        running sequences when the pool is empty. False if ``seq`` itself was preempted."""
        while len(seq.table) < seq.blocks_needed(self.pool.block_size):
            if self.pool.available() == 0:
                victim = max(self._running, key=lambda s: s.queue_key)
                self._preempt(victim)
                if victim is seq:
                    return False
                continue
            seq.table.append(self.pool.allocate())
        return True

    def _admit(self, seq: Sequence) -> bool:
        """Takes the blocks a waiting sequence needs, cached prefix first; False if it must
        wait for free blocks."""
        # A prompt still to be scored is computed whole: a cached block has no logits.
        hits = [] if seq.scores_prompt else self._prefix_hits(seq)
        reusable_idle = sum(1 for block, _ in hits if self.pool.is_idle(block))
        new_blocks = seq.blocks_needed(self.pool.block_size) - len(hits)
        if new_blocks > self.pool.available() - reusable_idle:
            return False
        for _, content in hits:
            block = self.pool.lookup(content)
            if block is None:  # cannot happen: nothing ran since _prefix_hits
                raise RuntimeError("prefix cache changed during admission")
            seq.table.append(block)
        seq.hashes = [content for _, content in hits]
        seq.computed = len(hits) * self.pool.block_size
        seq.table += [self.pool.allocate() for _ in range(new_blocks)]
        if seq.generated == 0:
            self.stats.prompt_tokens += seq.prompt_len
            self.stats.prefix_hit_tokens += seq.computed
        if seq.cached_tokens < 0:  # a recompute after preemption hits its own blocks
            seq.cached_tokens = seq.computed
        if seq.preempted_at is not None:  # back after a preemption
            self.stats.preempted_seconds += time.monotonic() - seq.preempted_at
            self.stats.recomputed_tokens += len(seq.tokens) - seq.computed
            seq.preempted_at = None
        return True

    def _prefix_hits(self, seq: Sequence) -> list[tuple[int, int]]:
        """(block, content hash) of cached blocks matching the sequence's leading full
        blocks. At least one token is always left to compute, for the step's logits."""
        size = self.pool.block_size
        hits: list[tuple[int, int]] = []
        parent = seq.root
        for index in range((len(seq.tokens) - 1) // size):
            content = block_hash(parent, tuple(seq.tokens[index * size : (index + 1) * size]))
            block = self.pool.cached(content)
            if block is None:
                break
            hits.append((block, content))
            parent = content
        return hits

    def _preempt(self, seq: Sequence) -> None:
        seq.release(self.pool)
        self._running.remove(seq)
        self._enqueue(seq)  # its arrival keeps its place among its priority's
        seq.preemptions += 1
        seq.preempted_at = time.monotonic()
        self.stats.preemptions += 1

    # -- running a step -----------------------------------------------------------------

    def _run(self, batch: list[tuple[Sequence, int]]) -> None:
        segments = [
            Segment(
                seq.tokens[seq.computed : seq.computed + n],
                seq.computed,
                seq.table[: -(-(seq.computed + n) // self.pool.block_size)],
            )
            for seq, n in batch
        ]
        self.stats.prefill_tokens += sum(
            n for seq, n in batch if not (len(seq.pending) == 1 and seq.generated > 0)
        )
        rows, lasts = logit_rows(batch)
        try:
            every = self.model.forward(segments, self.pool, rows)
        except Exception as exc:
            log.exception("forward pass failed")
            for seq, _ in batch:
                self._fail(seq, f"generation failed: {exc}")
            return
        logits = every if rows is None else every[lasts]
        if rows is not None:
            score_prompts(batch, every, lasts, self.tokenizer.decode)
        # Only a sequence whose whole prompt is now computed samples its next token.
        ready = [i for i, (seq, n) in enumerate(batch) if seq.computed + n == len(seq.tokens)]
        for seq, n in batch:
            seq.computed += n
        samplers = [batch[i][0].sampler for i in ready]
        tokens = sample_batch(samplers, logits[ready]) if ready else []
        for i, token in enumerate(_spread(ready, tokens, len(batch))):
            seq = batch[i][0]
            try:
                seq.register_full_blocks(self.pool)
                if token is not None:
                    if seq.scores_tokens:
                        self._score(seq, logits[i], token)
                    self._advance(seq, token)
            except Exception as exc:  # one bad sequence must not take the batch down
                log.exception("sequence failed")
                self._fail(seq, f"generation failed: {exc}")

    def _score(self, seq: Sequence, logits: npt.NDArray[np.float32], token: int) -> None:
        """The token's log probability (and the most likely tokens'), for its response."""
        logprob, rank, top = score_token(logits, token, seq.request.sampling.logprobs or 0)
        seq.cumulative_logprob += logprob
        if seq.request.return_logprobs:
            text = self.tokenizer.decode
            seq.unsent_logprobs.append(
                TokenLogprob(
                    token, text([token]), logprob, rank, tuple((i, text([i]), lp) for i, lp in top)
                )
            )

    def _advance(self, seq: Sequence, token: int) -> None:
        if seq.sampler.dead_end:  # the grammar left no token the model may write
            self._fail(seq, STRUCTURE_DEAD_END)
            return
        if seq.sampler.exhausted:  # no token was left to draw (bad words took the last)
            self._finish(seq, STOP)
            return
        seq.tokens.append(token)
        seq.unsent_tokens += 1
        self.stats.generation_tokens += 1
        constraint = seq.sampler.constraint
        if constraint is not None and constraint.failed:
            # The grammar could not follow the output (the model's own output mask and the
            # grammar left no common token, or the grammar outgrew its limits; an end
            # before the structure is whole is one): the request's structure, not this
            # engine.
            why = constraint.failed.splitlines()[0][:MAX_GRAMMAR_REASON]
            if token in self.tokenizer.eos_ids:
                why = "no token the model may write continues it; the model could only end"
            self._fail(seq, f"{STRUCTURE_FIELD}: the output cannot go on within it ({why})")
            return
        if token in self.tokenizer.eos_ids:
            self._finish(seq, STOP)
            return
        text = seq.decoder.push(token)
        # Stop strings count once the output has more than min_tokens (vLLM's rule).
        released = seq.stops.push(text, matching=seq.generated > seq.min_tokens)
        if released:
            seq.note_text(released)
            seq.text.append(released)
            seq.unsent_text.append(released)
        if seq.request.stream and seq.unsent_text and self._due(seq):
            self._emit(seq)
        ends = token in seq.request.sampling.stop_token_ids and seq.generated > seq.min_tokens
        if ends or seq.stops.stopped or (constraint is not None and constraint.complete):
            self._finish(seq, STOP)
        elif seq.generated >= seq.max_new:
            self._finish(seq, LENGTH)

    def _emit(self, seq: Sequence) -> None:
        seq.sink.emit("".join(seq.unsent_text), seq.unsent_tokens, seq.details())
        seq.unsent_text.clear()
        seq.unsent_tokens = 0
        seq.sent_at = self._clock()
        seq.responses += 1

    def _send_due(self) -> None:
        """Text held for the stream gap goes out once the gap has passed, whether or not
        its sequence computed a token in this step (less urgent ones may pause)."""
        for seq in self._running:
            if seq.request.stream and seq.unsent_text and self._due(seq):
                self._emit(seq)

    def _due(self, seq: Sequence) -> bool:
        """Whether a sequence's held text goes out now: its first text always does (time to
        first token); later, every ``stream_interval`` tokens. By default the interval grows
        with the batch, so that per-response costs do not eat the batching gains, but not
        beyond the largest power of two in the tokens generated so far: responses after
        tokens 1, 3, 7, 15, then at the batch's interval, and with the token that ends its
        first word. A client then sees its first words as soon as they end (an
        output check holds a word until then), at the cost of a response or two per
        sequence. With a stream gap, a later response also waits until
        that long after the previous one: the model's ``stream_gap_ms``, or the request's
        own once its ``stream_gap_after`` responses have gone; the first text and the
        first word's end never wait."""
        if len(seq.text) == len(seq.unsent_text):
            return True
        fixed = self.config.stream_interval
        if not fixed and seq.first_word_tokens == seq.generated:
            return True
        interval = fixed or min(
            -(-len(self._running) // AUTO_STREAM_DIVISOR), 1 << (seq.generated.bit_length() - 1)
        )
        asked = seq.request.stream_gap
        if asked and seq.responses >= asked.after:
            gap_s = asked.seconds
        else:
            gap_s = self.config.stream_gap_ms / 1000
        return seq.unsent_tokens >= interval and (not gap_s or self._clock() - seq.sent_at >= gap_s)

    def _finish(self, seq: Sequence, reason: str) -> None:
        tail = "" if seq.stops.stopped else seq.stops.push(seq.decoder.flush()) + seq.stops.flush()
        details = seq.details()
        # Before its last response: a client that has it finds the request counted.
        self._publish(force=True)
        if seq.request.stream:
            seq.sink.finish("".join(seq.unsent_text) + tail, seq.unsent_tokens, reason, details)
        else:
            prefix = "" if seq.request.exclude_input_in_output else seq.request.prompt
            seq.sink.finish(prefix + "".join(seq.text) + tail, seq.generated, reason, details)
        self._retire(seq, reason)

    def _fail(self, seq: Sequence, message: str) -> None:
        try:
            seq.sink.fail(message)
        except Exception:
            log.exception("could not report a failure to the client")
        self._retire(seq, ERROR)

    def _retire(self, seq: Sequence, reason: str) -> None:
        seq.release(self.pool)
        if seq in self._running:
            self._running.remove(seq)
        elif seq in self._waiting:
            self._waiting.remove(seq)
        self.stats.finished[reason] += 1

    def _publish(self, force: bool) -> None:
        now = time.monotonic()
        if not force and now - self._published_at < STATS_INTERVAL_S:
            return
        self._published_at = now
        pool = self.pool.stats()
        self.stats.running = len(self._running)
        # Requests submitted during the step in progress are not a queue yet: the next step
        # admits them if there is room. Counted, a burst of arrivals into an engine with
        # room read as a queue, and a router as saturation.
        self.stats.waiting = len(self._waiting)
        self.stats.waiting_by_priority = Counter(seq.priority for seq in self._waiting)
        self.stats.kv_blocks_used = pool.used
        self._on_stats(self.stats)


def _spread(indexes: list[int], values: list[int], size: int) -> list[int | None]:
    """``values`` placed at ``indexes`` of a list of ``size``, None elsewhere."""
    out: list[int | None] = [None] * size
    for index, value in zip(indexes, values, strict=True):
        out[index] = value
    return out

"""One request's state inside the engine: its tokens, KV blocks and output stream."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

from refengine.contract import GenerationRequest
from refengine.kvcache import BlockPool, block_hash, root_hash
from refengine.sampling import OutputMasks, Sampler
from refengine.stops import StopMatcher
from refengine.structured import Constraint
from refengine.tokenizer import StreamDecoder

LENGTH, STOP, CANCELLED, ERROR = "length", "stop", "cancelled", "error"


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log probability under the model (its raw next-token
    distribution, before temperature and masks, as vLLM reports by default), its rank in
    that distribution, and the most likely tokens there: (id, text, log probability)."""

    token: int
    text: str
    logprob: float
    rank: int  # 1: the most likely token; 0: a prompt's first, which nothing precedes
    top: tuple[tuple[int, str, float], ...] = ()


@dataclass(frozen=True)
class Details:
    """What a response carries besides text, each only when the request asked for it:
    its tokens' log probabilities, the generation's cumulative log probability so far,
    the prompt's token count, and (on the first response) how many of the prompt's tokens
    were read from the prefix cache."""

    logprobs: tuple[TokenLogprob, ...] | None = None
    cumulative_logprob: float | None = None
    num_input_tokens: int | None = None
    num_cached_tokens: int | None = None
    # The prompt's tokens' (first response; see SamplingParams.prompt_logprobs).
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None
    prompt_token_ids: tuple[int, ...] | None = None  # the prompt's ids (first response)

    def then(self, later: Details | None) -> Details:
        """This response's details followed by a later one's, as one response."""
        if later is None:
            return self
        logprobs = None
        if self.logprobs is not None or later.logprobs is not None:
            logprobs = (self.logprobs or ()) + (later.logprobs or ())
        cached = later.num_cached_tokens
        if cached is None:
            cached = self.num_cached_tokens
        prompt = self.prompt_logprobs if later.prompt_logprobs is None else later.prompt_logprobs
        ids = self.prompt_token_ids if later.prompt_token_ids is None else later.prompt_token_ids
        return Details(
            logprobs, later.cumulative_logprob, later.num_input_tokens, cached, prompt, ids
        )


def logprob_entry(token: TokenLogprob) -> dict[str, dict[str, object]]:
    """One position as vLLM's backend writes it: {token id: {logprob, rank, decoded_token}}
    for the sampled token and the most likely ones. A prompt's first token (rank 0:
    nothing precedes it) has a null log probability and rank."""
    scored = token.rank > 0
    entry: dict[str, dict[str, object]] = {
        str(token.token): {
            "logprob": token.logprob if scored else None,
            "rank": token.rank if scored else None,
            "decoded_token": token.text,
        }
    }
    for rank, (i, text, logprob) in enumerate(token.top, start=1):
        entry.setdefault(str(i), {"logprob": logprob, "rank": rank, "decoded_token": text})
    return entry


class Sink(Protocol):
    """Where one request's output goes (a Triton response sender, or a test double)."""

    def is_cancelled(self) -> bool: ...

    def emit(self, text: str, num_tokens: int, details: Details | None = None) -> None:
        """A streamed delta: ``num_tokens`` new tokens produced ``text``."""

    def finish(
        self, text: str, num_tokens: int, reason: str, details: Details | None = None
    ) -> None:
        """The last response of the request."""

    def fail(self, message: str) -> None:
        """The request failed; ``message`` is safe to show the client."""


@dataclass(eq=False)  # a sequence is itself: the engine's lists find it by identity
class Sequence:
    request: GenerationRequest
    sink: Sink
    tokens: list[int]  # prompt, then generated tokens
    prompt_len: int
    max_new: int  # max_tokens, bounded by the context length
    decoder: StreamDecoder
    masks: OutputMasks
    arrived_at: float = field(default_factory=time.monotonic)
    computed: int = 0  # tokens whose keys and values are in the cache
    table: list[int] = field(default_factory=list)  # block ids
    hashes: list[int] = field(default_factory=list)  # content hash per full block
    next_cancel_check: float = 0.0
    unsent_tokens: int = 0
    sent_at: float = 0.0  # the engine's clock at its last response
    responses: int = 0  # streamed responses sent
    unsent_text: list[str] = field(default_factory=list)  # streamed text held back
    text: list[str] = field(default_factory=list)
    unsent_logprobs: list[TokenLogprob] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    # With prompt_logprobs: the prompt's tokens from prompt_from on (an added BOS is not
    # the client's text), scored in order as their positions are computed.
    prompt_from: int = 0
    prompt_scores: list[TokenLogprob] = field(default_factory=list)
    prompt_reported: bool = False
    cached_tokens: int = -1  # prompt tokens its first admission found cached (-1: not yet)
    cached_reported: bool = False
    prompt_ids_reported: bool = False
    order: int = 0  # its place in arrival order (the engine numbers its requests)
    preemptions: int = 0
    preempted_at: float | None = None  # when it was last preempted (None: running, or new)
    # Its text so far has a non-space character (a word has begun); once a space follows
    # one, first_word_tokens is the tokens generated by then (0: not yet).
    word_begun: bool = False
    first_word_tokens: int = 0
    # The prompt's last tokens that are output of its own from before (a stream resumed
    # elsewhere): its penalties count them as output.
    resumed_output_tokens: int = 0
    constraint: Constraint | None = None  # a structured output's grammar
    banned: tuple[tuple[int, ...], ...] = ()  # bad words' token sequences
    sampler: Sampler = field(init=False)
    stops: StopMatcher = field(init=False)

    def __post_init__(self) -> None:
        prompt = self.tokens[: self.prompt_len]
        resumed = prompt[len(prompt) - self.resumed_output_tokens :]
        if self.constraint is not None and resumed:
            self.constraint.accept_all(resumed)
        self.sampler = Sampler(
            self.request.sampling, self.masks, prompt, resumed, self.constraint, banned=self.banned
        )
        sampling = self.request.sampling
        self.stops = StopMatcher(sampling.stop, sampling.include_stop_str_in_output)

    @property
    def priority(self) -> int:
        return self.request.priority

    @property
    def root(self) -> int:
        """Its first block's parent hash: its cache partition (the request's salt)."""
        return root_hash(self.request.cache_salt)

    @property
    def queue_key(self) -> tuple[int, int]:
        """Waiting order: the most urgent first (lowest priority value), then arrival."""
        return self.request.priority, self.order

    @property
    def scores_tokens(self) -> bool:
        """Whether its tokens' log probabilities are wanted (they cost a softmax each)."""
        r = self.request
        return r.sampling.logprobs is not None or r.return_logprobs or r.return_cumulative_logprob

    @property
    def scores_prompt(self) -> bool:
        """Whether some of its prompt's tokens are still to be scored."""
        wanted = self.request.sampling.prompt_logprobs is not None
        return wanted and self.prompt_from + len(self.prompt_scores) < self.prompt_len

    def details(self) -> Details | None:
        """The details its next response carries (taking the unsent log probabilities)."""
        r = self.request
        cached = None  # reported once, on the first response
        if r.return_num_cached_tokens and not self.cached_reported and self.cached_tokens >= 0:
            cached, self.cached_reported = self.cached_tokens, True
        prompt = self._prompt_logprobs()
        ids = None  # reported once, on the first response
        if r.return_prompt_token_ids and not self.prompt_ids_reported:
            ids, self.prompt_ids_reported = tuple(self.tokens[: self.prompt_len]), True
        if not (
            r.return_logprobs
            or r.return_cumulative_logprob
            or r.return_num_input_tokens
            or cached is not None
            or prompt is not None
            or ids is not None
        ):
            return None
        logprobs = tuple(self.unsent_logprobs) if r.return_logprobs else None
        self.unsent_logprobs.clear()
        return Details(
            logprobs,
            self.cumulative_logprob if r.return_cumulative_logprob else None,
            self.prompt_len if r.return_num_input_tokens else None,
            cached,
            prompt,
            ids,
        )

    def _prompt_logprobs(self) -> tuple[TokenLogprob, ...] | None:
        """The prompt's log probabilities, once, when all are scored."""
        wanted = self.request.sampling.prompt_logprobs is not None
        if not wanted or self.prompt_reported or self.scores_prompt:
            return None
        self.prompt_reported = True
        return tuple(self.prompt_scores)

    @property
    def min_tokens(self) -> int:
        return self.request.sampling.min_tokens

    @property
    def generated(self) -> int:
        return len(self.tokens) - self.prompt_len

    def note_text(self, released: str) -> None:
        """Follows its released text until its first word has ended: a streamed output
        check shows a word once the character after it does."""
        if self.first_word_tokens:
            return
        for char in released:
            if not char.isspace():
                self.word_begun = True
            elif self.word_begun:
                self.first_word_tokens = self.generated
                return

    def starting(self, first_tokens: int) -> bool:
        """Whether its first words are still to come: its first word has not ended and it
        has generated fewer than ``first_tokens`` tokens (the bound for text without
        spaces: URLs, base64, minified JSON)."""
        return not self.first_word_tokens and self.generated < first_tokens

    @property
    def pending(self) -> list[int]:
        """Tokens to run through the model next (the whole prompt, or the last sampled)."""
        return self.tokens[self.computed :]

    def blocks_needed(self, block_size: int) -> int:
        """Blocks the sequence holds once its pending tokens are computed."""
        return -(-len(self.tokens) // block_size)

    def release(self, pool: BlockPool) -> None:
        pool.release(self.table)
        self.table, self.hashes, self.computed = [], [], 0

    def register_full_blocks(self, pool: BlockPool) -> None:
        """Publishes every block that became full for prefix reuse."""
        size = pool.block_size
        while len(self.hashes) < self.computed // size:
            index = len(self.hashes)
            parent = self.hashes[-1] if self.hashes else self.root
            content = block_hash(parent, tuple(self.tokens[index * size : (index + 1) * size]))
            pool.register(self.table[index], content)
            self.hashes.append(content)

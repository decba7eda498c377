"""One request's state inside the engine: its tokens, KV blocks and output stream."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

from refengine.contract import GenerationRequest
from refengine.kvcache import NO_PARENT, BlockPool, block_hash
from refengine.sampling import OutputMasks, Sampler
from refengine.stops import StopMatcher
from refengine.tokenizer import StreamDecoder

LENGTH, STOP, CANCELLED, ERROR = "length", "stop", "cancelled", "error"


class Sink(Protocol):
    """Where one request's output goes (a Triton response sender, or a test double)."""

    def is_cancelled(self) -> bool: ...

    def emit(self, text: str, num_tokens: int) -> None:
        """A streamed delta: ``num_tokens`` new tokens produced ``text``."""

    def finish(self, text: str, num_tokens: int, reason: str) -> None:
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
    unsent_text: list[str] = field(default_factory=list)  # streamed text held back
    text: list[str] = field(default_factory=list)
    sampler: Sampler = field(init=False)
    stops: StopMatcher = field(init=False)

    def __post_init__(self) -> None:
        self.sampler = Sampler(self.request.sampling, self.masks)
        self.stops = StopMatcher(self.request.sampling.stop)

    @property
    def generated(self) -> int:
        return len(self.tokens) - self.prompt_len

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
            parent = self.hashes[-1] if self.hashes else NO_PARENT
            content = block_hash(parent, tuple(self.tokens[index * size : (index + 1) * size]))
            pool.register(self.table[index], content)
            self.hashes.append(content)

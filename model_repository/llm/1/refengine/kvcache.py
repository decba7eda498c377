"""Paged KV cache: a fixed pool of blocks, reference counts, and automatic prefix caching.

Every block holds the keys and values of ``block_size`` consecutive tokens for all layers.
A full block is identified by a content hash chained from its parent block (as vLLM's
automatic prefix caching does), so a new sequence whose prompt starts with cached blocks
reuses them instead of recomputing them. Blocks nobody references stay cached until the
pool needs them back, least recently used first.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

NO_PARENT = 0


def block_hash(parent: int, tokens: tuple[int, ...]) -> int:
    return hash((parent, tokens))


def root_hash(salt: str) -> int:
    """The parent of a sequence's first block: NO_PARENT unsalted, else one that only
    the same salt gives (a cache partition per salt)."""
    if not salt:
        return NO_PARENT
    return int.from_bytes(hashlib.blake2b(salt.encode(), digest_size=8).digest(), "little") | 1


@dataclass
class PoolStats:
    total: int
    free: int  # neither referenced nor cached
    cached_idle: int  # cached, unreferenced, evictable

    @property
    def used(self) -> int:
        return self.total - self.free - self.cached_idle


class BlockPool:
    def __init__(
        self, num_blocks: int, block_size: int, n_layers: int, n_heads: int, head_dim: int
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("the KV cache needs at least one block of at least one token")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # kv[layer]: [num_blocks, block_size, 2 (keys, values), heads, head_dim]. A block is
        # one contiguous run of memory (a gather copies whole blocks), and a token's keys
        # and values for every head are one row (a write stores whole rows).
        shape = (n_layers, num_blocks, block_size, 2, n_heads, head_dim)
        self.kv: npt.NDArray[np.float32] = np.zeros(shape, dtype=np.float32)
        # Bumped each time a block is handed out: a copy of a block's contents is current
        # while its generation is unchanged (a held block's written tokens never change).
        self.generations = np.zeros(num_blocks, dtype=np.int64)
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._refs = [0] * num_blocks
        self._hash_of: dict[int, int] = {}  # block -> content hash (full blocks only)
        self._block_of: dict[int, int] = {}  # content hash -> block
        self._idle: OrderedDict[int, None] = OrderedDict()  # cached and unreferenced, LRU first

    def stats(self) -> PoolStats:
        return PoolStats(self.num_blocks, len(self._free), len(self._idle))

    def available(self) -> int:
        """Blocks that can be handed out now (free, or cached and evictable)."""
        return len(self._free) + len(self._idle)

    def allocate(self) -> int:
        """A block for new tokens; evicts the least recently used idle cached block if needed."""
        if self._free:
            block = self._free.pop()
        elif self._idle:
            block, _ = self._idle.popitem(last=False)
            del self._block_of[self._hash_of.pop(block)]
        else:
            raise MemoryError("KV cache pool exhausted")
        self._refs[block] = 1
        self.generations[block] += 1
        return block

    def cached(self, content_hash: int) -> int | None:
        """The block holding this content, if cached (takes no reference)."""
        return self._block_of.get(content_hash)

    def is_idle(self, block: int) -> bool:
        return block in self._idle

    def lookup(self, content_hash: int) -> int | None:
        """Takes a reference on the cached block with this content, if any."""
        block = self._block_of.get(content_hash)
        if block is None:
            return None
        if self._refs[block] == 0:
            del self._idle[block]
        self._refs[block] += 1
        return block

    def register(self, block: int, content_hash: int) -> None:
        """Marks a just-filled block as holding this content, so later prompts can reuse it."""
        if block in self._hash_of or content_hash in self._block_of:
            return  # already cached (same content computed twice stays one entry)
        self._hash_of[block] = content_hash
        self._block_of[content_hash] = block

    def release(self, blocks: list[int]) -> None:
        """Drops one reference from each block; unreferenced ones become free or idle-cached."""
        for block in blocks:
            self._refs[block] -= 1
            if self._refs[block] > 0:
                continue
            if block in self._hash_of:
                self._idle[block] = None
            else:
                self._free.append(block)

    def slots(self, table: list[int], start: int, end: int) -> npt.NDArray[np.intp]:
        """Cache slots of token positions [start, end) of a sequence with this block table."""
        positions = np.arange(start, end)
        blocks = np.asarray(table, dtype=np.intp)[positions // self.block_size]
        slots: npt.NDArray[np.intp] = blocks * self.block_size + positions % self.block_size
        return slots

"""What the router remembers of where prompts went: prefix blocks and sessions.

The prefix index approximates each replica's prefix cache the way llm-d's and the vLLM
production stack's routers do: the prompt is cut into fixed-size character blocks, each
hashed together with its parent (so a hash names a whole prefix), and every block sent to
a replica is remembered for it, least recently used first out.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

BLOCK_CHARS = 64
MAX_BLOCKS = 64  # prefixes beyond 4096 characters gain nothing more


def prefix_hashes(prompt: str) -> list[int]:
    """Chained hashes of the prompt's full blocks: the i-th names characters [0, 64*(i+1))."""
    hashes, parent = [], 0
    full = min(len(prompt) // BLOCK_CHARS, MAX_BLOCKS)
    for start in range(0, full * BLOCK_CHARS, BLOCK_CHARS):
        parent = hash((parent, prompt[start : start + BLOCK_CHARS]))
        hashes.append(parent)
    return hashes


class PrefixIndex:
    """Block hash -> replicas that were sent it, bounded, least recently used evicted."""

    def __init__(self, capacity: int = 200_000) -> None:
        self._capacity = capacity
        self._holders: OrderedDict[int, set[str]] = OrderedDict()

    def record(self, hashes: Iterable[int], address: str) -> None:
        for h in hashes:
            holders = self._holders.get(h)
            if holders is None:
                self._holders[h] = {address}
            else:
                holders.add(address)
                self._holders.move_to_end(h)
        while len(self._holders) > self._capacity:
            self._holders.popitem(last=False)

    def matched_blocks(self, hashes: list[int]) -> dict[str, int]:
        """Replica -> how many leading blocks of the prompt it was sent before."""
        matched: dict[str, int] = {}
        for i, h in enumerate(hashes):
            holders = self._holders.get(h)
            if not holders:
                break
            extended = False
            for address in holders:
                if matched.get(address, 0) == i:  # its prefix reaches this block
                    matched[address] = i + 1
                    extended = True
            if not extended:
                break
        return matched


class SessionTable:
    """Session key -> the replica serving that conversation, bounded LRU."""

    def __init__(self, capacity: int = 100_000) -> None:
        self._capacity = capacity
        self._where: OrderedDict[str, str] = OrderedDict()

    def get(self, key: str) -> str | None:
        return self._where.get(key)

    def set(self, key: str, address: str) -> None:
        self._where[key] = address
        self._where.move_to_end(key)
        if len(self._where) > self._capacity:
            self._where.popitem(last=False)

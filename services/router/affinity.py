"""What the router remembers of where prompts went: prefix blocks and sessions.

The prefix index approximates each replica's prefix cache the way llm-d's and the vLLM
production stack's routers do: the prompt is cut into fixed-size character blocks, each
hashed together with its parent (so a hash names a whole prefix), and every block sent to
a replica is remembered for it, least recently used first out.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable

BLOCK_CHARS = 64
MAX_BLOCKS = 64  # prefixes beyond 4096 characters gain nothing more


def prefix_hashes(prompt: str, salt: str = "") -> list[int]:
    """Chained hashes of the prompt's full blocks: the i-th names characters [0, 64*(i+1)).
    BLAKE2b, not ``hash()``: every router must name a prefix alike (Python salts str
    hashes per process); 64 blocks take about 30 us. ``salt``: the request's prefix-cache
    partition (the engine's ``cache_salt``): only the same salt names a prefix alike."""
    hashes, parent = [], salt.encode("utf-8", "surrogatepass")
    full = min(len(prompt) // BLOCK_CHARS, MAX_BLOCKS)
    for start in range(0, full * BLOCK_CHARS, BLOCK_CHARS):
        block = prompt[start : start + BLOCK_CHARS].encode("utf-8", "surrogatepass")
        parent = hashlib.blake2b(parent + block, digest_size=8).digest()
        hashes.append(int.from_bytes(parent, "little"))
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
    """Session key -> the replica serving that conversation and its subset (the version
    it talks to), bounded LRU."""

    def __init__(self, capacity: int = 100_000) -> None:
        self._capacity = capacity
        self._where: OrderedDict[str, tuple[str, str]] = OrderedDict()

    def get(self, key: str) -> str | None:
        found = self._where.get(key)
        return found[0] if found else None

    def subset(self, key: str) -> str | None:
        found = self._where.get(key)
        return found[1] if found else None

    def set(self, key: str, address: str, subset: str = "") -> None:
        self._where[key] = (address, subset)
        self._where.move_to_end(key)
        if len(self._where) > self._capacity:
            self._where.popitem(last=False)

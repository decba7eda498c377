"""Causal self-attention over the paged KV cache, shared by every model family.

A step's tokens come from many sequences; each attends over exactly its own length, never
padded, so its numbers do not depend on the rest of the batch. Queries may have more
heads than keys and values (grouped-query attention): query head ``h`` reads key/value
head ``h // (heads / kv_heads)``, as Llama's ``repeat_kv`` pairs them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from refengine.kvcache import BlockPool

Array = npt.NDArray[np.float32]


@dataclass(frozen=True)
class Segment:
    """Tokens of one sequence to run this step, after ``start`` tokens already in the cache.

    ``table`` holds the cache blocks of positions [0, start + len(tokens)), in order.
    """

    tokens: list[int]
    start: int
    table: list[int]


@dataclass(frozen=True)
class Step:
    """What every layer of one forward pass shares: where each token sits, where its keys
    and values go, and how the segments group for attention."""

    tokens: list[int]
    positions: npt.NDArray[np.intp]
    writes: npt.NDArray[np.intp]  # cache slot of each token
    ends: npt.NDArray[np.intp]  # one past each segment's last row
    groups: list[Group]

    @classmethod
    def of(cls, segments: list[Segment], pool: BlockPool, max_context: int) -> Step:
        positions = np.concatenate(
            [np.arange(seg.start, seg.start + len(seg.tokens)) for seg in segments]
        )
        if positions.max() >= max_context:
            raise ValueError("a sequence exceeds the model's context length")
        writes = np.concatenate(
            [pool.slots(seg.table, seg.start, seg.start + len(seg.tokens)) for seg in segments]
        )
        return cls(
            tokens=[t for seg in segments for t in seg.tokens],
            positions=positions,
            writes=writes,
            ends=np.cumsum([len(seg.tokens) for seg in segments]),
            groups=_attention_groups(segments),
        )


@dataclass(frozen=True)
class Group:
    """Segments of one start and length, whose attention runs as one batched product."""

    rows: npt.NDArray[np.intp]  # [segments, count]: their tokens' rows in the step
    tables: npt.NDArray[np.intp]  # [segments, blocks]: their cache blocks
    length: int  # start + count: every segment's attended length
    mask: Array | None  # causal mask of a prompt chunk; None for one new token


class PagedAttention:
    """Writes a layer's new keys and values to the pool and attends over each sequence's
    cached ones. One per model: it keeps the last step's key/value reads (``KVReads``)."""

    def __init__(self) -> None:
        self._reads = KVReads()

    def next_step(self) -> None:
        self._reads.next_step()

    def __call__(self, pool: BlockPool, layer: int, step: Step, q: Array, kv: Array) -> Array:
        """``q`` [tokens, heads, hd], already scaled; ``kv`` [tokens, 2, kv_heads, hd].
        Returns [tokens, heads * hd]."""
        tokens, heads, hd = q.shape
        kv_heads = kv.shape[2]
        share = heads // kv_heads  # query heads per key/value head
        pool.kv[layer].reshape(-1, 2, kv_heads, hd)[step.writes] = kv
        queries = q.transpose(1, 0, 2)  # [heads, tokens, hd]
        out = np.empty((heads, tokens, hd), dtype=np.float32)
        for group in step.groups:
            keys, values = self._reads.read(pool, layer, group, kv[group.rows])
            count = group.rows.shape[1]
            # [group, kv heads, share * count, hd]: the query heads of one key head together.
            grouped = queries[:, group.rows].transpose(1, 0, 2, 3)
            grouped = grouped.reshape(len(group.rows), kv_heads, share * count, hd)
            scores = grouped @ keys.transpose(0, 1, 3, 2)
            if group.mask is not None:  # the same causal mask for each query head
                per_head = scores.reshape(*scores.shape[:2], share, count, -1)
                per_head += group.mask
            attended = (_softmax(scores) @ values).reshape(len(group.rows), heads, count, hd)
            out[:, group.rows] = attended.transpose(1, 0, 2, 3)
        return out.transpose(1, 0, 2).reshape(tokens, heads * hd)


def _attention_groups(segments: list[Segment]) -> list[Group]:
    """Segments of the same start and length (decode tokens of same-length sequences,
    prompts of the same length) run as one batched product: the same per-head matrices,
    in one call."""
    offsets = np.cumsum([0, *(len(seg.tokens) for seg in segments)])
    members: dict[tuple[int, int], list[int]] = {}
    for i, seg in enumerate(segments):
        members.setdefault((seg.start, len(seg.tokens)), []).append(i)
    return [
        Group(
            rows=offsets[group][:, None] + np.arange(count),
            tables=np.array([segments[i].table for i in group], dtype=np.intp),
            length=start + count,
            mask=_causal_mask(start, count),
        )
        for (start, count), group in members.items()
    ]


class KVReads:
    """The keys and values each attention group read in the last step, per layer.

    A group decoding on the same blocks next step reads them all again plus one token per
    sequence: it writes those tokens into its copy instead of gathering every block again.
    Only the last step's copies are kept: memory for about one more copy of the running
    sequences' keys and values, which saves copying them all on every step.
    """

    def __init__(self) -> None:
        self._last: dict[tuple[int, bytes, bytes], tuple[Array, int]] = {}
        self._this: dict[tuple[int, bytes, bytes], tuple[Array, int]] = {}

    def next_step(self) -> None:
        self._last, self._this = self._this, {}

    def read(self, pool: BlockPool, layer: int, group: Group, new: Array) -> tuple[Array, Array]:
        """Keys and values [group, kv heads, length, hd]; ``new`` holds the group's tokens
        of this step [group, count, 2, kv heads, hd], already written to the pool."""
        key = (layer, group.tables.tobytes(), pool.generations[group.tables].tobytes())
        start = group.length - new.shape[1]
        kept = self._last.pop(key, None)
        if kept is not None and kept[1] == start:
            flat = kept[0]
            flat[:, start : group.length] = new
        else:
            flat = _gather(pool.kv[layer], group.tables)
        self._this[key] = (flat, group.length)
        keys, values = flat[:, : group.length].transpose(2, 0, 3, 1, 4)
        return keys, values


def _gather(blocks: Array, tables: npt.NDArray[np.intp]) -> Array:
    """The group's whole blocks, copied (one contiguous run each), as [group, positions,
    2, kv heads, hd]: the per-head matrices are strided views of it, which BLAS reads as
    they are."""
    gathered = np.take(blocks, tables, axis=0)
    group, count, size, two, heads, hd = gathered.shape
    flat: Array = gathered.reshape(group, count * size, two, heads, hd)
    return flat


def _causal_mask(start: int, count: int) -> Array | None:
    if count == 1:
        return None  # a single new token may see everything before it
    rows = np.arange(count)[:, None] + start
    cols = np.arange(start + count)[None, :]
    return np.where(cols > rows, np.float32(-1e9), np.float32(0.0)).astype(np.float32)


def _softmax(x: Array) -> Array:
    """Softmax over the last axis, in place."""
    x -= x.max(axis=-1, keepdims=True)
    np.exp(x, out=x)
    x /= x.sum(axis=-1, keepdims=True)
    return x

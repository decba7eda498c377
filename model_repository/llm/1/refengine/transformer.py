"""A GPT-style decoder-only transformer, forward pass only, in numpy (float32).

Weights are drawn deterministically from a seed (no pretrained weights are available
offline); the output layer adds a unigram prior over English text so that sampled output
looks like text rather than uniform noise. The structure is a real pre-LayerNorm decoder:
token + sinusoidal position embeddings, causal multi-head self-attention reading a KV
cache, a GELU MLP, residual connections, and a final LayerNorm and projection.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from refengine.kvcache import BlockPool
from refengine.rowstable import matmul, probe_layout
from refengine.tokenizer import EOS, VOCAB_SIZE

Array = npt.NDArray[np.float32]

# Text the output prior is estimated from (character frequencies only).
_PRIOR_TEXT = (
    "The quick brown fox jumps over the lazy dog. Once upon a time there was a small "
    "model that served many tenants through a mesh of services, and every request found "
    "the replica with the most room. It streamed its tokens one at a time, and when the "
    "client went away it stopped at once. Where the cache held a prefix, the prompt was "
    "read only once; where it did not, the engine computed the keys and values again.\n"
)
_PRINTABLE = [*range(32, 127), 10]


@dataclass(frozen=True)
class ModelShape:
    n_layers: int = 4
    d_model: int = 192
    n_heads: int = 4
    d_ff: int = 768
    max_context: int = 2048
    vocab_size: int = VOCAB_SIZE
    # Logit offset of the end-of-sequence token: lower means longer generations.
    eos_logit_bias: float = -2.0

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ValueError("d_model must be a multiple of n_heads")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @classmethod
    def from_parameters(cls, params: Mapping[str, str]) -> ModelShape:
        """From the model's config.pbtxt parameters; an absent one keeps its default."""
        names = ("n_layers", "d_model", "n_heads", "d_ff", "max_context")
        return cls(**{name: int(params[name]) for name in names if name in params})


@dataclass
class _Layer:
    ln1_g: Array
    ln1_b: Array
    w_qkv: Array
    w_o: Array
    ln2_g: Array
    ln2_b: Array
    w_up: Array
    w_down: Array


@dataclass(frozen=True)
class Segment:
    """Tokens of one sequence to run this step, after ``start`` tokens already in the cache.

    ``table`` holds the cache blocks of positions [0, start + len(tokens)), in order.
    """

    tokens: list[int]
    start: int
    table: list[int]


class Transformer:
    def __init__(self, shape: ModelShape, seed: int = 0) -> None:
        self.shape = shape
        rng = np.random.default_rng(seed)
        d, v = shape.d_model, shape.vocab_size

        def normal(*dims: int, std: float) -> Array:
            return rng.normal(0.0, std, size=dims).astype(np.float32)

        self.tok_emb = normal(v, d, std=1.0)
        self.pos_emb = _sinusoidal(shape.max_context, d)
        residual_std = 0.02 / np.sqrt(2 * shape.n_layers) * np.sqrt(d)
        self.layers = [
            _Layer(
                ln1_g=np.ones(d, np.float32),
                ln1_b=np.zeros(d, np.float32),
                w_qkv=normal(d, 3 * d, std=1.0 / np.sqrt(d)),
                w_o=normal(d, d, std=residual_std / np.sqrt(d)),
                ln2_g=np.ones(d, np.float32),
                ln2_b=np.zeros(d, np.float32),
                w_up=normal(d, shape.d_ff, std=1.0 / np.sqrt(d)),
                w_down=normal(shape.d_ff, d, std=residual_std / np.sqrt(shape.d_ff)),
            )
            for _ in range(shape.n_layers)
        ]
        self.lnf_g = np.ones(d, np.float32)
        self.lnf_b = np.zeros(d, np.float32)
        self.w_out = normal(d, v, std=1.5 / np.sqrt(d))
        self.out_bias = _output_prior(v, shape.eos_logit_bias)
        self._reads = _KVReads()
        # BLAS probed now, for these very matrices, not during the first request.
        self._layouts = {
            id(w): probe_layout(w)
            for layer in self.layers
            for w in (layer.w_qkv, layer.w_o, layer.w_up, layer.w_down)
        } | {id(self.w_out): probe_layout(self.w_out)}

    def _matmul(self, a: Array, w: Array) -> Array:
        return matmul(a, w, self._layouts[id(w)])

    def forward(self, segments: list[Segment], pool: BlockPool) -> Array:
        """One step for a whole batch: prefill segments and decode tokens together.

        Every projection and MLP is one matrix product over all the batch's tokens;
        attention reads each sequence's keys and values from its own cache blocks. Returns
        the next-token logits of each segment, [segments, vocab].
        """
        tokens = [t for seg in segments for t in seg.tokens]
        positions = np.concatenate(
            [np.arange(seg.start, seg.start + len(seg.tokens)) for seg in segments]
        )
        if positions.max() >= self.shape.max_context:
            raise ValueError("a sequence exceeds the model's context length")
        writes = np.concatenate(
            [pool.slots(seg.table, seg.start, seg.start + len(seg.tokens)) for seg in segments]
        )
        ends = np.cumsum([len(seg.tokens) for seg in segments])
        groups = _attention_groups(segments)  # the same for every layer
        self._reads.next_step()
        x = self.tok_emb[tokens] + self.pos_emb[positions]
        for index, layer in enumerate(self.layers):
            h = _layer_norm(x, layer.ln1_g, layer.ln1_b)
            attended = self._attention(layer, index, h, groups=groups, writes=writes, pool=pool)
            x = x + self._matmul(attended, layer.w_o)
            h = _layer_norm(x, layer.ln2_g, layer.ln2_b)
            x = x + self._matmul(_gelu(self._matmul(h, layer.w_up)), layer.w_down)
        last = _layer_norm(x[ends - 1], self.lnf_g, self.lnf_b)
        logits: Array = self._matmul(last, self.w_out) + self.out_bias
        return logits

    def _attention(
        self,
        layer: _Layer,
        index: int,
        h: Array,
        *,
        groups: list[_Group],
        writes: npt.NDArray[np.intp],
        pool: BlockPool,
    ) -> Array:
        shape = self.shape
        qkv = self._matmul(h, layer.w_qkv).reshape(len(h), 3, shape.n_heads, shape.head_dim)
        blocks = pool.kv[index]  # [blocks, block size, 2, heads, hd]
        blocks.reshape(-1, 2, shape.n_heads, shape.head_dim)[writes] = qkv[:, 1:]
        queries = (qkv[:, 0] * np.float32(1.0 / np.sqrt(shape.head_dim))).transpose(1, 0, 2)
        out = np.empty((shape.n_heads, len(h), shape.head_dim), dtype=np.float32)
        for group in groups:
            keys, values = self._reads.read(pool, index, group, qkv[group.rows, 1:])
            q = queries[:, group.rows].transpose(1, 0, 2, 3)  # [group, heads, count, hd]
            scores = q @ keys.transpose(0, 1, 3, 2)
            if group.mask is not None:
                scores += group.mask
            out[:, group.rows] = (_softmax(scores) @ values).transpose(1, 0, 2, 3)
        return out.transpose(1, 0, 2).reshape(len(h), shape.d_model)


@dataclass(frozen=True)
class _Group:
    """Segments of one start and length, whose attention runs as one batched product."""

    rows: npt.NDArray[np.intp]  # [segments, count]: their tokens' rows in the step
    tables: npt.NDArray[np.intp]  # [segments, blocks]: their cache blocks
    length: int  # start + count: every segment's attended length
    mask: Array | None  # causal mask of a prompt chunk; None for one new token


def _attention_groups(segments: list[Segment]) -> list[_Group]:
    """Each sequence attends over exactly its own length, never padded, so its numbers do
    not depend on the rest of the batch. Segments of the same start and length (decode
    tokens of same-length sequences, prompts of the same length) run as one batched
    product: the same per-head matrices, in one call."""
    offsets = np.cumsum([0, *(len(seg.tokens) for seg in segments)])
    members: dict[tuple[int, int], list[int]] = {}
    for i, seg in enumerate(segments):
        members.setdefault((seg.start, len(seg.tokens)), []).append(i)
    return [
        _Group(
            rows=offsets[group][:, None] + np.arange(count),
            tables=np.array([segments[i].table for i in group], dtype=np.intp),
            length=start + count,
            mask=_causal_mask(start, count),
        )
        for (start, count), group in members.items()
    ]


class _KVReads:
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

    def read(self, pool: BlockPool, layer: int, group: _Group, new: Array) -> tuple[Array, Array]:
        """Keys and values [group, heads, length, hd]; ``new`` holds the group's tokens of
        this step [group, count, 2, heads, hd], already written to the pool."""
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
        return keys, values  # each [group, heads, length, hd]


def _gather(blocks: Array, tables: npt.NDArray[np.intp]) -> Array:
    """The group's whole blocks, copied (one contiguous run each), as [group, positions,
    2, heads, hd]: the per-head matrices are strided views of it, which BLAS reads as
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


def _layer_norm(x: Array, g: Array, b: Array) -> Array:
    centered = x - x.mean(axis=-1, keepdims=True)
    var = (centered * centered).mean(axis=-1, keepdims=True)
    out: Array = centered / np.sqrt(var + np.float32(1e-5)) * g + b
    return out


def _gelu(x: Array) -> Array:
    """GELU's tanh approximation, as ``x * sigmoid(2z)``: the same function as
    ``0.5x(1 + tanh(z))``, and numpy's exp runs twice as fast as its tanh."""
    inner = x * x
    inner *= np.float32(-2.0 * 0.7978845608 * 0.044715)
    inner += np.float32(-2.0 * 0.7978845608)
    inner *= x  # -2z
    with np.errstate(over="ignore"):  # exp(-2z) overflows for very negative x: GELU is -0
        np.exp(inner, out=inner)
    inner += np.float32(1.0)
    np.divide(x, inner, out=inner)
    return inner


def _softmax(x: Array) -> Array:
    """Softmax over the last axis, in place."""
    x -= x.max(axis=-1, keepdims=True)
    np.exp(x, out=x)
    x /= x.sum(axis=-1, keepdims=True)
    return x


def _sinusoidal(positions: int, d: int) -> Array:
    pos = np.arange(positions, dtype=np.float64)[:, None]
    freq = np.exp(-np.log(10000.0) * np.arange(0, d, 2, dtype=np.float64) / d)
    table = np.zeros((positions, d), dtype=np.float64)
    table[:, 0::2] = np.sin(pos * freq)
    table[:, 1::2] = np.cos(pos * freq)
    return table.astype(np.float32)


def _output_prior(vocab: int, eos_bias: float) -> Array:
    """Log character frequencies of English-like text; unseen printable bytes get a floor."""
    counts = Counter(_PRIOR_TEXT.encode("ascii"))
    total = sum(counts.values())
    prior = np.full(vocab, np.log(0.2 / total), dtype=np.float32)
    for byte in _PRINTABLE:
        prior[byte] = np.log((counts.get(byte, 0) + 0.2) / total)
    prior[EOS] = np.log(1.0 / total) + eos_bias
    return prior

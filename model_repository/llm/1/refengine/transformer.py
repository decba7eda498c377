"""A GPT-style decoder-only transformer, forward pass only, in numpy (float32).

Weights are drawn deterministically from a seed (no pretrained weights are available
offline); the output layer adds a unigram prior over English text so that sampled output
looks like text rather than uniform noise. The structure is a real pre-LayerNorm decoder:
token + sinusoidal position embeddings, causal multi-head self-attention reading a KV
cache, a GELU MLP, residual connections, and a final LayerNorm and projection.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

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
    d_model: int = 256
    n_heads: int = 4
    d_ff: int = 1024
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


class KVCache:
    """Keys and values of one sequence, for every layer: [layers, heads, capacity, head_dim]."""

    def __init__(self, shape: ModelShape, capacity: int) -> None:
        dims = (shape.n_layers, shape.n_heads, capacity, shape.head_dim)
        self.k = np.zeros(dims, dtype=np.float32)
        self.v = np.zeros(dims, dtype=np.float32)
        self.length = 0

    @property
    def capacity(self) -> int:
        return int(self.k.shape[2])


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

    def new_cache(self, capacity: int) -> KVCache:
        return KVCache(self.shape, min(capacity, self.shape.max_context))

    def forward(self, tokens: list[int], cache: KVCache) -> Array:
        """Runs ``tokens`` after the cache's contents; returns the next-token logits [vocab].

        Prefill passes the whole prompt at once; decode passes one token.
        """
        start, count = cache.length, len(tokens)
        if start + count > cache.capacity:
            raise ValueError(f"sequence of {start + count} tokens exceeds the KV cache")
        x = self.tok_emb[tokens] + self.pos_emb[start : start + count]
        mask = _causal_mask(start, count)
        for index, layer in enumerate(self.layers):
            x = x + self._attention(
                layer,
                index,
                _layer_norm(x, layer.ln1_g, layer.ln1_b),
                cache,
                start=start,
                mask=mask,
            )
            h = _layer_norm(x, layer.ln2_g, layer.ln2_b)
            x = x + _gelu(h @ layer.w_up) @ layer.w_down
        cache.length = start + count
        last = _layer_norm(x[-1:], self.lnf_g, self.lnf_b)[0]
        logits: Array = last @ self.w_out + self.out_bias
        return logits

    def _attention(
        self, layer: _Layer, index: int, h: Array, cache: KVCache, *, start: int, mask: Array | None
    ) -> Array:
        shape = self.shape
        count = h.shape[0]
        qkv = (h @ layer.w_qkv).reshape(count, 3, shape.n_heads, shape.head_dim)
        q, k, v = (qkv[:, i].transpose(1, 0, 2) for i in range(3))  # [heads, count, hd]
        end = start + count
        cache.k[index, :, start:end] = k
        cache.v[index, :, start:end] = v
        keys, values = cache.k[index, :, :end], cache.v[index, :, :end]
        scores = q @ keys.transpose(0, 2, 1) * np.float32(1.0 / np.sqrt(shape.head_dim))
        if mask is not None:
            scores = scores + mask
        out = _softmax(scores) @ values  # [heads, count, hd]
        merged: Array = out.transpose(1, 0, 2).reshape(count, shape.d_model) @ layer.w_o
        return merged


def _causal_mask(start: int, count: int) -> Array | None:
    if count == 1:
        return None  # a single new token may see everything before it
    rows = np.arange(count)[:, None] + start
    cols = np.arange(start + count)[None, :]
    return np.where(cols > rows, np.float32(-1e9), np.float32(0.0)).astype(np.float32)


def _layer_norm(x: Array, g: Array, b: Array) -> Array:
    mean = x.mean(axis=-1, keepdims=True)
    var = x.var(axis=-1, keepdims=True)
    out: Array = (x - mean) / np.sqrt(var + np.float32(1e-5)) * g + b
    return out


def _gelu(x: Array) -> Array:
    # tanh approximation; x*x*x is several times faster than x**3 in numpy.
    inner = x * x * x
    inner *= np.float32(0.044715)
    inner += x
    inner *= np.float32(0.7978845608)
    np.tanh(inner, out=inner)
    inner += np.float32(1.0)
    inner *= x
    inner *= np.float32(0.5)
    return inner


def _softmax(x: Array) -> Array:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    out: Array = e / e.sum(axis=-1, keepdims=True)
    return out


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

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
from pathlib import Path

import numpy as np
import numpy.typing as npt

from refengine.attention import PagedAttention, Segment, Step
from refengine.kvcache import BlockPool
from refengine.rowstable import LayoutBook, matmul
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

    @property
    def n_kv_heads(self) -> int:
        return self.n_heads  # every head has keys and values of its own

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


class Transformer:
    def __init__(
        self,
        shape: ModelShape,
        seed: int = 0,
        layouts_dir: Path | None = None,
        batch_invariant: bool = True,
    ) -> None:
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
        self._attention = PagedAttention()
        # BLAS probed now, for these very matrices, not during the first request.
        book = LayoutBook(layouts_dir, batch_invariant)
        self._layouts = {
            id(w): book.layout(w)
            for layer in self.layers
            for w in (layer.w_qkv, layer.w_o, layer.w_up, layer.w_down)
        } | {id(self.w_out): book.layout(self.w_out)}
        book.save()

    def _matmul(self, a: Array, w: Array) -> Array:
        return matmul(a, w, self._layouts[id(w)])

    def forward(
        self, segments: list[Segment], pool: BlockPool, rows: npt.NDArray[np.intp] | None = None
    ) -> Array:
        """One step for a whole batch: prefill segments and decode tokens together.

        Every projection and MLP is one matrix product over all the batch's tokens;
        attention reads each sequence's keys and values from its own cache blocks. Returns
        the next-token logits of each segment, [segments, vocab], or with ``rows`` those
        after each of these of the step's tokens, [rows, vocab].
        """
        step = Step.of(segments, pool, self.shape.max_context)
        self._attention.next_step()
        x = self.tok_emb[step.tokens] + self.pos_emb[step.positions]
        for index, layer in enumerate(self.layers):
            h = _layer_norm(x, layer.ln1_g, layer.ln1_b)
            attended = self._attend(layer, index, h, step, pool)
            x = x + self._matmul(attended, layer.w_o)
            h = _layer_norm(x, layer.ln2_g, layer.ln2_b)
            x = x + self._matmul(_gelu(self._matmul(h, layer.w_up)), layer.w_down)
        last = _layer_norm(x[step.ends - 1 if rows is None else rows], self.lnf_g, self.lnf_b)
        logits: Array = self._matmul(last, self.w_out) + self.out_bias
        return logits

    def _attend(self, layer: _Layer, index: int, h: Array, step: Step, pool: BlockPool) -> Array:
        shape = self.shape
        qkv = self._matmul(h, layer.w_qkv).reshape(len(h), 3, shape.n_heads, shape.head_dim)
        queries = qkv[:, 0] * np.float32(1.0 / np.sqrt(shape.head_dim))
        return self._attention(pool, index, step, queries, qkv[:, 1:])


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

"""The Llama family (SmolLM2, TinyLlama, Llama 2 and 3 shapes), forward pass only, in
numpy, from pretrained weights (checkpoint.py).

Pre-RMSNorm decoder blocks: rotary position embeddings on queries and keys (adjacent pairs
rotated together, as GGUF stores Llama's Q and K), grouped-query attention over the paged
KV cache, a SwiGLU MLP; a final RMSNorm and the output projection (the token embedding,
when the file ties the two). Every weight product goes through ``rowstable``, so that a
sequence's logits do not depend on the rest of its batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from refengine.attention import PagedAttention, Segment, Step
from refengine.checkpoint import Checkpoint, LlamaShape
from refengine.kvcache import BlockPool
from refengine.quant import OUTPUT_KIND, Weight, quantize
from refengine.rowstable import Layout, LayoutBook, matmul

Array = npt.NDArray[np.float32]


@dataclass
class _Block:
    attn_norm: Array
    w_qkv: Weight  # [d, (heads + 2 kv heads) * hd]: Q, K and V in one product
    w_o: Weight
    ffn_norm: Array
    w_gate_up: Weight  # [d, 2 * ff]: the gate and up projections in one product
    w_down: Weight


class Llama:
    def __init__(
        self,
        checkpoint: Checkpoint,
        max_context: int | None = None,
        layouts_dir: Path | None = None,
        weights: str = "float32",
        batch_invariant: bool = True,
    ) -> None:
        """``weights``: how the matrices are kept (quant.py: float32, int8, q4);
        ``batch_invariant`` False: plain products, faster, but a row's logits may differ
        in their last bits with the rest of its batch (rowstable)."""
        shape = checkpoint.shape
        if max_context:  # a deployment may serve less context than the model was trained on
            shape = _with_context(shape, min(max_context, shape.max_context))
        self.shape = shape
        t = checkpoint.tensors
        self.weights = weights
        # Weights are stored [out, in]; products take [in, out]. The output projection is
        # the token embedding when the file ties them: its columns are the embeddings.
        # Copies, not views of the checkpoint: a model must not keep the whole cached file
        # mapped (and counted in its resident memory) once its weights are quantized.
        out = np.array(t.get("output.weight", t["token_embd.weight"])).T
        self.w_out = quantize(out, OUTPUT_KIND.get(weights, weights))
        self._tied = "output.weight" not in t
        self._embedding = None if self._tied else np.array(t["token_embd.weight"])
        self.blocks = [self._block(t, f"blk.{i}.", weights) for i in range(shape.n_layers)]
        self.final_norm = np.array(t["output_norm.weight"])
        self._rope = _rope_tables(shape)
        self._attention = PagedAttention()
        self._layouts: dict[int, Layout | None] = {}
        self._probe_layouts(LayoutBook(layouts_dir, batch_invariant))

    @staticmethod
    def _block(t: dict[str, Array], prefix: str, weights: str) -> _Block:
        def fused(*names: str) -> Weight:
            matrix = np.concatenate([t[prefix + n].T for n in names], axis=1)
            return quantize(np.ascontiguousarray(matrix), weights)

        return _Block(
            attn_norm=np.array(t[prefix + "attn_norm.weight"]),
            w_qkv=fused("attn_q.weight", "attn_k.weight", "attn_v.weight"),
            w_o=fused("attn_output.weight"),
            ffn_norm=np.array(t[prefix + "ffn_norm.weight"]),
            w_gate_up=fused("ffn_gate.weight", "ffn_up.weight"),
            w_down=fused("ffn_down.weight"),
        )

    def embed(self, tokens: list[int]) -> Array:
        """The tokens' embeddings [tokens, d]."""
        if self._embedding is not None:
            embedded: Array = self._embedding[tokens].astype(np.float32)
            return embedded
        return np.ascontiguousarray(self.w_out.columns(np.asarray(tokens, dtype=np.intp)).T)

    @property
    def matrices(self) -> list[Weight]:
        """Every matrix a step multiplies by, once each."""
        blocks = [w for b in self.blocks for w in (b.w_qkv, b.w_o, b.w_gate_up, b.w_down)]
        return [*blocks, self.w_out]

    @property
    def weight_bytes(self) -> int:
        """Memory the matrices take as kept (norms and an untied embedding aside)."""
        return sum(w.nbytes for w in self.matrices)

    def _probe_layouts(self, book: LayoutBook) -> None:
        """The output projection's alike positions are found on its first columns
        (probing all of a 49k-wide matrix would take minutes)."""
        for block in self.blocks:
            for w in (block.w_qkv, block.w_o, block.w_gate_up, block.w_down):
                self._layouts[id(w)] = book.layout(w.expand())
        out = self.w_out.expand()
        self._layouts[id(self.w_out)] = book.layout(out, probe_on=out[:, :1024])
        book.save()

    def _matmul(self, a: Array, w: Weight) -> Array:
        return matmul(a, w.expand(), self._layouts[id(w)])

    def forward(
        self, segments: list[Segment], pool: BlockPool, rows: npt.NDArray[np.intp] | None = None
    ) -> Array:
        """One step for a whole batch (prefill chunks and decode tokens together);
        returns the next-token logits of each segment, [segments, vocab], or with
        ``rows`` those after each of these of the step's tokens, [rows, vocab] (what
        scoring a text teacher-forced needs)."""
        shape = self.shape
        step = Step.of(segments, pool, shape.max_context)
        self._attention.next_step()
        cos, sin = self._rope[0][step.positions], self._rope[1][step.positions]
        x = self.embed(step.tokens)
        for index, block in enumerate(self.blocks):
            h = _rms_norm(x, block.attn_norm, shape.norm_eps)
            x = x + self._matmul(self._attend(index, h, step, pool, (cos, sin)), block.w_o)
            h = _rms_norm(x, block.ffn_norm, shape.norm_eps)
            x = x + self._matmul(_swiglu(self._matmul(h, block.w_gate_up)), block.w_down)
        last = x[step.ends - 1 if rows is None else rows]
        return self._matmul(_rms_norm(last, self.final_norm, shape.norm_eps), self.w_out)

    def _attend(
        self, index: int, h: Array, step: Step, pool: BlockPool, rope: tuple[Array, Array]
    ) -> Array:
        shape, block = self.shape, self.blocks[index]
        hd, heads, kv_heads = shape.head_dim, shape.n_heads, shape.n_kv_heads
        qkv = self._matmul(h, block.w_qkv).reshape(len(h), heads + 2 * kv_heads, hd)
        queries = _rotate(qkv[:, :heads], *rope) * np.float32(1.0 / np.sqrt(hd))
        kv = np.empty((len(h), 2, kv_heads, hd), dtype=np.float32)
        kv[:, 0] = _rotate(qkv[:, heads : heads + kv_heads], *rope)
        kv[:, 1] = qkv[:, heads + kv_heads :]
        return self._attention(pool, index, step, queries, kv)


def _with_context(shape: LlamaShape, max_context: int) -> LlamaShape:
    fields = {**shape.__dict__, "max_context": max_context}
    return LlamaShape(**fields)


def _rope_tables(shape: LlamaShape) -> tuple[Array, Array]:
    """cos and sin of every position's angles, [positions, rope dims / 2]."""
    pairs = np.arange(0, shape.rope_dims, 2, dtype=np.float64) / shape.rope_dims
    inverse = 1.0 / (shape.rope_base**pairs)
    angles = np.arange(shape.max_context, dtype=np.float64)[:, None] * inverse[None, :]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def _rotate(x: Array, cos: Array, sin: Array) -> Array:
    """Rotary embedding of x [tokens, heads, hd]: each adjacent pair (2i, 2i+1) of the
    first rope dims turned by its position's angle i."""
    rotated = x.copy()
    dims = 2 * cos.shape[1]
    even, odd = x[..., 0:dims:2], x[..., 1:dims:2]
    c, s = cos[:, None, :], sin[:, None, :]
    rotated[..., 0:dims:2] = even * c - odd * s
    rotated[..., 1:dims:2] = even * s + odd * c
    return rotated


def _rms_norm(x: Array, weight: Array, eps: float) -> Array:
    # One reduction per row, in place where it can be: a decode step calls this 61 times
    # on one row, where numpy's mean() alone costs more than the arithmetic.
    mean_square = np.add.reduce(x * x, axis=-1, keepdims=True)
    mean_square *= np.float32(1.0 / x.shape[-1])
    mean_square += np.float32(eps)
    out: Array = x / np.sqrt(mean_square)
    out *= weight
    return out


def _swiglu(gate_up: Array) -> Array:
    """silu(gate) * up, the halves of one product. The gate is clamped where exp(-gate)
    would overflow: silu is -0 there in float32 anyway."""
    half = gate_up.shape[1] // 2
    gate, up = gate_up[:, :half], gate_up[:, half:]
    denominator = np.exp(-np.maximum(gate, np.float32(-88.0)))
    denominator += np.float32(1.0)
    out: Array = gate / denominator
    out *= up
    return out

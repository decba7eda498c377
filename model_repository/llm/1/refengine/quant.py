"""Weights kept quantized in memory: per-channel int8, and 4-bit in groups of 32.

A product with a quantized matrix expands it to float32 first (numpy has no int8 or 4-bit
matrix kernels; an engine on a GPU fuses the expansion into the product). The expanded
matrix is the same array layout every time, so the batch-invariant product
(``rowstable``) holds for it as for a float32 matrix.

- ``int8``: symmetric, one scale per output channel: w = q * scale, q in [-127, 127].
- ``q4``: a scale and a minimum (float16) per 32 consecutive input rows of each output
  channel (llama.cpp's Q4_1, laid out for [in, out] products): w = q * scale + minimum,
  q in [0, 15], two values a byte; 5 bits a weight.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt

Array = npt.NDArray[np.float32]
GROUP = 32


class Weight(Protocol):
    """A matrix [in, out] as a product uses it."""

    @property
    def shape(self) -> tuple[int, int]: ...

    def expand(self) -> Array:
        """The matrix in float32, [in, out]."""

    def columns(self, ids: npt.NDArray[np.intp]) -> Array:
        """Some of its columns in float32, [in, len(ids)] (a tied embedding's rows)."""

    @property
    def nbytes(self) -> int: ...


@dataclass(frozen=True)
class Float32Weight:
    matrix: Array

    @property
    def shape(self) -> tuple[int, int]:
        rows, cols = self.matrix.shape
        return rows, cols

    def expand(self) -> Array:
        return self.matrix

    def columns(self, ids: npt.NDArray[np.intp]) -> Array:
        out: Array = self.matrix[:, ids].astype(np.float32)
        return out

    @property
    def nbytes(self) -> int:
        return int(self.matrix.nbytes)


@dataclass(frozen=True)
class Int8Weight:
    q: npt.NDArray[np.int8]  # [in, out]
    scale: Array  # [out]

    @classmethod
    def of(cls, matrix: Array) -> Int8Weight:
        peak = np.abs(matrix).max(axis=0)
        scale = np.where(peak > 0, peak / 127.0, 1.0).astype(np.float32)
        q = np.clip(np.rint(matrix / scale), -127, 127).astype(np.int8)
        return cls(q, scale)

    @property
    def shape(self) -> tuple[int, int]:
        rows, cols = self.q.shape
        return rows, cols

    def expand(self) -> Array:
        out: Array = self.q.astype(np.float32)
        out *= self.scale
        return out

    def columns(self, ids: npt.NDArray[np.intp]) -> Array:
        out: Array = self.q[:, ids].astype(np.float32)
        out *= self.scale[ids]
        return out

    @property
    def nbytes(self) -> int:
        return int(self.q.nbytes + self.scale.nbytes)


@dataclass(frozen=True)
class Q4Weight:
    packed: npt.NDArray[np.uint8]  # [in / 2, out]: rows 2i (low nibble) and 2i+1 (high)
    scale: npt.NDArray[np.float16]  # [in / GROUP, out]
    minimum: npt.NDArray[np.float16]  # [in / GROUP, out]

    @classmethod
    def of(cls, matrix: Array) -> Q4Weight:
        rows, cols = matrix.shape
        if rows % GROUP:
            raise ValueError(f"q4 needs input rows in multiples of {GROUP}, got {rows}")
        groups = matrix.reshape(rows // GROUP, GROUP, cols)
        # A group's 16 levels span its own range: a group of weights already on a 4-bit
        # grid of 32 (as the SmolLM2 file's Q4_1 ones) keeps its values.
        low, high = groups.min(axis=1), groups.max(axis=1)
        scale = np.where(high > low, (high - low) / 15.0, 1.0).astype(np.float16)
        minimum = low.astype(np.float16)
        steps = (groups - minimum[:, None, :]) / scale[:, None, :].astype(np.float32)
        q = np.clip(np.rint(steps), 0, 15).astype(np.uint8).reshape(rows, cols)
        return cls((q[0::2] | (q[1::2] << 4)).astype(np.uint8), scale, minimum)

    @property
    def shape(self) -> tuple[int, int]:
        return self.packed.shape[0] * 2, self.packed.shape[1]

    def expand(self) -> Array:
        return _unpack(self.packed, self.scale, self.minimum)

    def columns(self, ids: npt.NDArray[np.intp]) -> Array:
        return _unpack(self.packed[:, ids], self.scale[:, ids], self.minimum[:, ids])

    @property
    def nbytes(self) -> int:
        return int(self.packed.nbytes + self.scale.nbytes + self.minimum.nbytes)


def _unpack(
    packed: npt.NDArray[np.uint8], scale: npt.NDArray[np.float16], minimum: npt.NDArray[np.float16]
) -> Array:
    rows, cols = packed.shape[0] * 2, packed.shape[1]
    q = np.empty((rows, cols), dtype=np.float32)
    q[0::2] = packed & 0x0F
    q[1::2] = packed >> 4
    groups = q.reshape(rows // GROUP, GROUP, cols)
    groups *= scale[:, None, :].astype(np.float32)
    groups += minimum[:, None, :].astype(np.float32)
    return q


QUANTIZED: dict[str, Callable[[Array], Weight]] = {"int8": Int8Weight.of, "q4": Q4Weight.of}
KINDS = ("float32", *QUANTIZED)
# The output projection (for a tied model, its token embedding too) takes no fewer than 8
# bits: every logit and, tied, every token's embedding goes through it, and 4 bits there
# cost far more than in the blocks (llama.cpp's 4-bit types keep it at 6 bits; the
# SmolLM2 file itself stores it in Q8_0).
OUTPUT_KIND = {"q4": "int8"}


def quantize(matrix: Array, kind: str) -> Weight:
    if kind == "float32":  # as it is: a transposed view stays one
        return Float32Weight(matrix)
    if kind not in QUANTIZED:
        raise ValueError(f"weights: {kind!r} is not one of {list(KINDS)}")
    return QUANTIZED[kind](np.ascontiguousarray(matrix, dtype=np.float32))

"""Matrix products whose rows do not depend on the rest of the batch.

BLAS computes a row of ``a @ b`` with a summation order that depends on where the row
falls in the matrix (which register tile, edge or middle), on the matrix's height and on
the orientation it is passed in. Batched, a sequence's row would then come out a few
ulps different from the same row computed alone, and a seeded sample could change. So a
product is taken in blocks of a few fixed heights, and rows are placed only at the
positions that compute exactly alike: probed once per weight matrix, at start.

Of the layouts that hold, the probe keeps the fastest as timed on the matrix itself, at
one row and at a batch: which one that is depends on the CPU's kernels more than on any
count of rows computed (a narrow product that packs a large matrix can cost many times
its gemm's arithmetic). A model that does not need batch invariance multiplies plainly
(``matmul`` with no layout): one row then goes through BLAS's matrix-vector kernel, whose
summation order no batched product shares.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

Array = npt.NDArray[np.float32]
Index = npt.NDArray[np.intp]

# Block heights the probe tries. 15 and 264: the widest blocks of this machine's
# OpenBLAS kernels (one small-matrix tile; a large block less its 8-row edges).
HEIGHTS = (1, 2, 4, 8, 12, 15, 16, 24, 32, 48, 64, 128, 264)
PROBES = 16  # rows of different scales: one row can agree by chance where kernels differ
TALL_PROBES = 4  # for blocks taller than 64, whose probe products are the costly ones
# The plans' cost model: a gemm call's fixed cost, in rows computed.
CALL_COST_ROWS = 16
# Batches a layout is timed at: one decode row, and a batch of decode rows.
TIMED_ROWS = (1, 32)
CACHED_PLAN_ROWS = 256
# Bump when the choice of layout changes: layouts kept from an older probe are probed again.
BOOK_VERSION = 2


@dataclass(frozen=True)
class Block:
    height: int
    slots: tuple[int, ...]  # positions whose rows compute alike

    @property
    def cost(self) -> int:
        return self.height + CALL_COST_ROWS

    @property
    def dense(self) -> bool:
        """Every position computes alike, so rows fill the block in order."""
        return len(self.slots) == self.height


_BEST: dict[tuple[Block, ...], list[tuple[int, int, int]]] = {}
_BEST_LOCK = threading.Lock()  # engines on other threads may share a table


@dataclass
class Layout:
    """How one matrix is multiplied: its orientation and the blocks rows may go in."""

    # True: a block enters BLAS transposed, so its rows are the kernel's vector lanes.
    transposed: bool
    blocks: tuple[Block, ...]
    _plans: dict[int, list[tuple[Block, Index, Index]]] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    # best[rows] = (cost, calls, block to add): the cheapest mix of blocks for that many
    # rows. One table per set of blocks, shared by the matrices that probed the same set
    # (most of a model's do), so a model builds it once, not once per matrix.
    _best: list[tuple[int, int, int]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        with _BEST_LOCK:
            self._best = _BEST.setdefault(self.blocks, [(0, 0, -1)])

    def plan(self, rows: int) -> list[tuple[Block, Index, Index]]:
        """Per block height used for ``rows`` rows: the block, and for each of its rows
        (in order) the block number and position it goes to. Plans of decode-sized
        batches are kept (they recur every step); larger ones are cheap next to their
        product and would make the cache grow with every prefill size."""
        plan = self._plans.get(rows)
        if plan is None:
            plan = self._make_plan(rows)
            if rows <= CACHED_PLAN_ROWS:
                self._plans[rows] = plan
        return plan

    def _extend(self, rows: int) -> None:
        """Fills ``_best`` up to ``rows``: the block to add last, by total cost, then calls."""
        if len(self._best) > rows:
            return
        with _BEST_LOCK:
            for total in range(len(self._best), rows + 1):
                options = []
                for index, block in enumerate(self.blocks):
                    cost, calls, _ = self._best[max(0, total - len(block.slots))]
                    options.append((cost + block.cost, calls + 1, index))
                self._best.append(min(options))

    def _make_plan(self, rows: int) -> list[tuple[Block, Index, Index]]:
        self._extend(rows)
        counts = [0] * len(self.blocks)
        left = rows
        while left > 0:
            index = self._best[left][2]
            counts[index] += 1
            left -= len(self.blocks[index].slots)
        plan = []
        left = rows
        used = [(block, n) for block, n in zip(self.blocks, counts, strict=True) if n]
        for block, count in sorted(used, key=lambda p: -p[0].height):
            placed = min(left, count * len(block.slots))
            numbers = np.repeat(np.arange(count), len(block.slots))[:placed]
            positions = np.tile(np.array(block.slots), count)[:placed]
            plan.append((block, numbers, positions))
            left -= placed
        return plan


def matmul(a: Array, b: Array, layout: Layout | None) -> Array:
    """``a @ b``, each row computed exactly as it would be alone; with no layout, plainly."""
    if layout is None:
        plain: Array = a @ b
        return plain
    parts = []
    first = 0
    for block, numbers, positions in layout.plan(a.shape[0]):
        rows, transposed = a[first : first + len(numbers)], layout.transposed
        if block.dense:
            parts.extend(_dense_product(rows, b, block.height, transposed))
        else:
            parts.append(_scattered_product(rows, b, block, (numbers, positions), transposed))
        first += len(numbers)
    if len(parts) == 1:
        return parts[0]
    return np.concatenate(parts)


def _dense_product(rows: Array, b: Array, height: int, transposed: bool) -> list[Array]:
    """Every position of the block computes alike: whole blocks are views of ``rows``,
    and only a last, partial block is padded."""
    whole = len(rows) - len(rows) % height
    parts = []
    if whole:
        blocks = rows[:whole].reshape(whole // height, height, rows.shape[1])
        parts.append(block_product(blocks, b, transposed).reshape(whole, b.shape[1]))
    if whole < len(rows):
        padded = np.zeros((1, height, rows.shape[1]), dtype=rows.dtype)
        padded[0, : len(rows) - whole] = rows[whole:]
        parts.append(block_product(padded, b, transposed)[0, : len(rows) - whole])
    return parts


def _scattered_product(
    rows: Array, b: Array, block: Block, places: tuple[Index, Index], transposed: bool
) -> Array:
    """Rows go only to the block's alike positions; the rest is padding."""
    numbers, positions = places
    padded = np.zeros((int(numbers[-1]) + 1, block.height, rows.shape[1]), dtype=rows.dtype)
    padded[numbers, positions] = rows
    # One gather of the wanted rows, even from a transposed product.
    product: Array = block_product(padded, b, transposed)[numbers, positions]
    return product


def block_product(blocks: Array, b: Array, transposed: bool) -> Array:
    """``blocks @ b``, one gemm per block; transposed, as ``(b.T @ block.T).T``."""
    if transposed:
        product: Array = (b.T @ blocks.transpose(0, 2, 1)).transpose(0, 2, 1)
        return product
    product = blocks @ b
    return product


def probe_layout(w: Array, probe_on: Array | None = None) -> Layout:
    """The fastest layout that multiplies rows by ``w`` exactly as alone (the BLAS threads
    must be set already: they change how BLAS splits a product). ``probe_on``: a part of
    ``w`` to find the alike positions on (the same memory layout, fewer columns); the
    candidates are timed on all of ``w``.

    Each candidate takes one orientation and one block position as the reference every
    row must compute exactly like.
    """
    candidates = _candidates(w if probe_on is None else probe_on)
    if not candidates:
        return Layout(False, (Block(1, (0,)),))  # nothing stable: a product per row
    if len(candidates) == 1:
        return candidates[0]
    return _fastest(candidates, w)


def _candidates(w: Array) -> list[Layout]:
    rng = np.random.default_rng(0)
    scales = rng.uniform(0.01, 100.0, size=(PROBES, 1)).astype(np.float32)
    rows = rng.normal(size=(PROBES, w.shape[0])).astype(np.float32) * scales
    candidates: list[Layout] = []
    for transposed in (False, True):
        # [height] -> [probe, position, out]: each probe row repeated down a whole block.
        products = {
            height: block_product(
                np.repeat(rows[: PROBES if height <= 64 else TALL_PROBES, None], height, axis=1),
                w,
                transposed,
            )
            for height in HEIGHTS
        }
        references = {p[:, 0].tobytes(): p[:, :1] for p in products.values() if len(p) == PROBES}
        for reference in references.values():
            blocks = _alike_blocks(products, reference)
            if blocks:
                candidates.append(Layout(transposed, blocks))
    return candidates


def _fastest(candidates: list[Layout], w: Array) -> Layout:
    """The candidate least slower than the best at its worst batch size: each is timed at
    every ``TIMED_ROWS`` (the best of two runs, after one to warm up)."""
    rng = np.random.default_rng(1)
    times = []
    for layout in candidates:
        per_size = []
        for rows in TIMED_ROWS:
            a = rng.normal(size=(rows, w.shape[0])).astype(np.float32)
            matmul(a, w, layout)
            per_size.append(min(_seconds(a, w, layout) for _ in range(2)))
        times.append(per_size)
    best = [min(column) for column in zip(*times, strict=True)]
    regret = [max(t / b for t, b in zip(row, best, strict=True)) for row in times]
    return candidates[int(np.argmin(regret))]


def _seconds(a: Array, w: Array, layout: Layout) -> float:
    started = time.perf_counter()
    matmul(a, w, layout)
    return time.perf_counter() - started


def _alike_blocks(products: dict[int, Array], reference: Array) -> tuple[Block, ...]:
    """Per block height, the positions computing exactly as ``reference``; a height is
    kept only if it holds more such positions than every lower one."""
    blocks: list[Block] = []
    for height, product in products.items():
        alike = (product == reference[: len(product)]).all(axis=(0, 2))
        slots = tuple(int(p) for p in np.flatnonzero(alike))
        if slots and (not blocks or len(slots) > len(blocks[-1].slots)):
            blocks.append(Block(height, slots))
    return tuple(blocks)


def machine_key() -> str:
    """What a probed layout holds for: this CPU, the BLAS library and its threads (the
    same matrix shape may compute otherwise on another machine or with more threads)."""
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        blas = "unknown-blas"
    else:
        found = [p for p in threadpool_info() if p.get("user_api") == "blas"]
        blas = "+".join(
            f"{p.get('internal_api')}-{p.get('version')}-{p.get('architecture')}-"
            f"{p.get('num_threads')}"
            for p in found
        )
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return hashlib.sha256(f"{cpu}|{blas}|{np.__version__}".encode()).hexdigest()[:16]


def layout_to_json(layout: Layout) -> dict[str, Any]:
    return {
        "transposed": layout.transposed,
        "blocks": [[b.height, list(b.slots)] for b in layout.blocks],
    }


def layout_from_json(doc: dict[str, Any]) -> Layout:
    blocks = tuple(Block(int(h), tuple(int(s) for s in slots)) for h, slots in doc["blocks"])
    return Layout(bool(doc["transposed"]), blocks)


# Layouts probed in this process, by machine and matrix: the choice is timed, so two
# probes of one shape could choose differently, and two models of the same weights must
# compute the same bits.
_PROBED: dict[str, Layout] = {}


class LayoutBook:
    """Layouts by matrix shape and memory layout: a model's matrices of one shape share
    them (a BLAS kernel's summation order depends on those, not on the values), so one
    probe serves them all, and every later model of this process. Probes take seconds:
    with a ``directory``, their results are kept there per machine (CPU, BLAS, threads)
    and read back on the next load, so that models in other processes choose alike."""

    def __init__(self, directory: Path | None, batch_invariant: bool = True) -> None:
        """``batch_invariant`` False: every matrix is multiplied plainly (no layout)."""
        self._invariant = batch_invariant
        self._machine = machine_key() if batch_invariant else ""
        name = f"layouts-v{BOOK_VERSION}-{self._machine}.json"
        self._path = directory / name if directory and batch_invariant else None
        self._found: dict[str, Any] = {}
        self._known: dict[str, Layout] = {}
        self._changed = False
        if self._path is not None and self._path.exists():
            with contextlib.suppress(OSError, ValueError):
                self._found = json.loads(self._path.read_text(encoding="utf-8"))

    def layout(self, w: Array, probe_on: Array | None = None) -> Layout | None:
        """``w``'s layout (None: multiply plainly); ``probe_on``: a part of it to find the
        alike positions on (probe_layout)."""
        if not self._invariant:
            return None
        key = f"{w.shape}{w.strides}"
        if key not in self._known:
            doc = self._found.get(key)
            if doc:
                self._known[key] = layout_from_json(doc)
            else:
                probed = f"{self._machine}{key}"
                if probed not in _PROBED:
                    _PROBED[probed] = probe_layout(w, probe_on)
                self._known[key] = _PROBED[probed]
                self._found[key] = layout_to_json(self._known[key])
                self._changed = True
        return self._known[key]

    def save(self) -> None:
        """Best effort: a read-only directory only means probing again next time."""
        if self._path is None or not self._changed:
            return
        with contextlib.suppress(OSError):
            self._path.parent.mkdir(parents=True, exist_ok=True)
            staging = self._path.with_suffix(f".{os.getpid()}.tmp")
            staging.write_text(json.dumps(self._found), encoding="utf-8")
            staging.replace(self._path)

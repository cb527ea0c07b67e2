"""A GGUF Q8_0 / Q4_0 tensor's blocks as `quant.layout` holds them (`Blocks`), another quantized type's as the
file has them (`RawBlocks`, for `quant.ggml_blocks`), and whether a family's transform of it only
moves whole rows and whole blocks (so the blocks can be kept as they are, not dequantized and re-quantized).

In the file a row of k weights is k / 32 blocks of (float16 d, then 32 int8 for Q8_0 or 16 nibble bytes for
Q4_0); `quant.layout` holds the same bytes split in two: the values [n, k] (int8) or [n, k / 2] (uint8), and
the scales d [n, k / 32]. A stacked tensor of MoE experts [experts, n, k] is held alike, with the experts
dimension in front (`quant.experts`).

A transform is tried on two index arrays of the tensor's shape, one holding each weight's row (counted through
the leading dimensions: expert e's row r is row e * n + r) and one its column: where every output row is one
input row, and its columns are whole input blocks in order, the output is those rows and blocks of the file's,
exactly. So a transform that moves whole experts, or whole rows of an expert (gate and up joined into one fused
tensor), keeps the blocks too.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..quant.ggml_blocks import TYPES
from ..quant.layout import BLOCK

# ggml type name -> (bytes of a block, bytes of its values)
KEPT = {"Q8_0": (34, 32), "Q4_0": (18, 16)}
RAW = tuple(t for t in TYPES if t not in KEPT)  # the other types held as the file's blocks (`quant.ggml_blocks`)


@dataclass
class Blocks:
    """One quantized weight in `quant.layout`'s form: `qs` values, `d` scales, `kind` "Q8_0" or "Q4_0"; 2-D, or
    3-D for stacked experts (leading dimensions in front of both)."""

    kind: str
    qs: torch.Tensor  # [..., n, k] int8 (Q8_0) or [..., n, k / 2] uint8 (Q4_0)
    d: torch.Tensor  # [..., n, k / 32] float16

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.d.shape[:-1], self.d.shape[-1] * BLOCK)

    def rows(self) -> Blocks:
        """The same blocks as a 2-D weight (the leading dimensions' rows one after another): views."""
        return Blocks(self.kind, self.qs.reshape(-1, self.qs.shape[-1]), self.d.reshape(-1, self.d.shape[-1]))

    def select(self, rows: torch.Tensor, blocks: torch.Tensor, lead: tuple[int, ...] = ()) -> Blocks:
        """These rows (of `rows()`), and in each these blocks, in this order; shaped [*lead, n, ...] when `lead`
        is given (stacked experts)."""
        flat = self.rows()
        n, nb = flat.d.shape
        if _all(rows, n) and _all(blocks, nb) and not lead:
            return flat  # nothing moved (most weights): no copy
        qs = flat.qs.reshape(n, nb, -1)[rows][:, blocks].reshape(len(rows), -1)
        d = flat.d[rows][:, blocks]
        if lead:
            qs, d = qs.reshape(*lead, -1, qs.shape[-1]), d.reshape(*lead, -1, d.shape[-1])
        return Blocks(self.kind, qs, d)


@dataclass
class RawBlocks:
    """One weight of a `RAW` type as the file's bytes: [..., n, k / weights a block * bytes a block] uint8."""

    kind: str
    raw: torch.Tensor
    k: int
    input_order: torch.Tensor | None = None  # the file's column of each HF column, where they were reordered

    @property
    def block(self) -> int:
        return TYPES[self.kind][1]

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.raw.shape[:-1], self.k)

    def rows(self) -> RawBlocks:
        return RawBlocks(self.kind, self.raw.reshape(-1, self.raw.shape[-1]), self.k)

    def select(self, rows: torch.Tensor, blocks: torch.Tensor, lead: tuple[int, ...] = ()) -> RawBlocks:
        """As `Blocks.select`."""
        flat = self.rows().raw
        if _all(rows, flat.shape[0]) and _all(blocks, self.k // self.block) and not lead:
            return RawBlocks(self.kind, flat, self.k)  # nothing moved (most weights): no copy
        size = TYPES[self.kind][2]
        raw = flat.reshape(flat.shape[0], -1, size)[rows][:, blocks].reshape(len(rows), -1)
        if lead:
            raw = raw.reshape(*lead, -1, raw.shape[-1])
        return RawBlocks(self.kind, raw, len(blocks) * self.block)


def _all(index: torch.Tensor, n: int) -> bool:
    """Whether `index` is 0, 1, ..., n - 1."""
    return len(index) == n and torch.equal(index, torch.arange(n))


def split_raw(kind: str, raw: np.ndarray) -> RawBlocks:
    """The file's bytes of a [..., n, k] weight of a `RAW` type: a view of the file's copy-on-write mapping
    (`file.readers`; a copy where the mapping is read-only)."""
    _, weights, size = TYPES[kind]
    data = torch.from_numpy(raw if raw.flags.writeable else np.array(raw))
    return RawBlocks(kind, data, raw.shape[-1] // size * weights)


def split(kind: str, raw: np.ndarray) -> Blocks:
    """The file's bytes of a [..., n, k] weight (uint8 [..., n, k / 32 * block bytes], as `GGUFReader` gives
    them)."""
    size = KEPT[kind][0]
    lead = raw.shape[:-1]
    blocks = torch.from_numpy(np.array(raw).reshape(*lead, -1, size))  # a copy: the file is mapped read-only
    d = blocks[..., :2].contiguous().view(torch.float16).reshape(*lead, -1)
    qs = blocks[..., 2:].contiguous().reshape(*lead, -1)
    return Blocks(kind, qs.view(torch.int8) if kind == "Q8_0" else qs, d)


EXACT = 1 << 24  # float32 holds every integer below it: the most rows (or columns) a probe can number


def probes(shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """(each weight's row, counted through the leading dimensions, and each weight's column) as float32 tensors of
    `shape` (exact below `EXACT`): views that repeat one row or one column (no memory of the weight's size: a
    248k-row embedding's probes as arrays took 2 GB at load), materialized only by a transform that reorders them."""
    *lead, k = shape
    n = int(np.prod(lead))
    rows = torch.arange(n, dtype=torch.float32).reshape(*lead, 1).expand(shape)
    cols = torch.arange(k, dtype=torch.float32).expand(shape)
    return rows, cols


def columns_reordered(row_out, col_out, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(input rows, the input column of each output column) where the transform's outputs of `probes(shape)` (2-D)
    are whole rows of the input with their columns reordered (any permutation), else None."""
    r, c = torch.as_tensor(row_out), torch.as_tensor(col_out)
    n, k = shape
    if r.dim() != 2 or r.shape != c.shape or r.shape[-1] != k or not r.dtype.is_floating_point:
        return None
    rows, cols = r[:, 0], c[0]
    if not (torch.equal(r, rows[:, None].expand_as(r)) and torch.equal(c, cols[None].expand_as(c))):
        return None
    if not (torch.equal(rows, rows.round()) and bool((rows >= 0).all() and (rows < n).all())):
        return None
    order = cols.long()
    if not torch.equal(order.sort().values, torch.arange(k)):
        return None
    return rows.long(), order


def moved(row_out, col_out, shape: tuple[int, ...], block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(input rows, input blocks) that the transform's outputs of `probes(shape)` are made of, or None where
    they are not whole rows and whole blocks (of `block` weights) of the input (values changed, columns mixed
    within a block, ...). Rows are counted through the leading dimensions, of the input and of the output alike
    (`Blocks.rows`)."""
    r, c = torch.as_tensor(row_out), torch.as_tensor(col_out)
    *lead, k = shape
    n = int(np.prod(lead))
    if r.dim() < 2 or r.shape != c.shape or r.shape[-1] % block or not r.dtype.is_floating_point:
        return None
    r, c = r.reshape(-1, r.shape[-1]), c.reshape(-1, c.shape[-1])
    rows, cols = r[:, 0], c[0]
    if not (torch.equal(r, rows[:, None].expand_as(r)) and torch.equal(c, cols[None].expand_as(c))):
        return None
    if not (torch.equal(rows, rows.round()) and torch.equal(cols, cols.round())):
        return None
    if rows.numel() and (rows.min() < 0 or rows.max() >= n or cols.min() < 0 or cols.max() >= k):
        return None
    cols = cols.long().reshape(-1, block)
    starts = cols[:, 0]
    if not (torch.equal(cols, starts[:, None] + torch.arange(block)) and bool((starts % block == 0).all())):
        return None
    return rows.long(), starts // block

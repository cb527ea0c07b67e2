"""A GGUF Q8_0 / Q4_0 tensor's blocks as `quant.layout` holds them, and whether a family's transform of it only
moves whole rows and whole blocks (so the blocks can be kept as they are, not dequantized and re-quantized).

In the file a row of k weights is k / 32 blocks of (float16 d, then 32 int8 for Q8_0 or 16 nibble bytes for
Q4_0); `quant.layout` holds the same bytes split in two: the values [n, k] (int8) or [n, k / 2] (uint8), and
the scales d [n, k / 32].

A transform is tried on two index arrays of the tensor's shape, one holding each weight's row and one its
column: where every output row is one input row, and its columns are whole input blocks in order, the output
is those rows and blocks of the file's, exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..quant.layout import BLOCK

# ggml type name -> (bytes of a block, bytes of its values)
KEPT = {"Q8_0": (34, 32), "Q4_0": (18, 16)}


@dataclass
class Blocks:
    """One 2-D quantized weight in `quant.layout`'s form: `qs` values, `d` scales, `kind` "Q8_0" or "Q4_0"."""

    kind: str
    qs: torch.Tensor  # [n, k] int8 (Q8_0) or [n, k / 2] uint8 (Q4_0)
    d: torch.Tensor  # [n, k / 32] float16

    @property
    def shape(self) -> tuple[int, int]:
        return self.d.shape[0], self.d.shape[1] * BLOCK

    def select(self, rows: torch.Tensor, blocks: torch.Tensor) -> "Blocks":
        """These rows, and in each these blocks, in this order."""
        n, nb = self.d.shape
        qs = self.qs.reshape(n, nb, -1)[rows][:, blocks].reshape(len(rows), -1)
        return Blocks(self.kind, qs, self.d[rows][:, blocks])


def split(kind: str, raw: np.ndarray) -> Blocks:
    """The file's bytes of a [n, k] weight (uint8 [n, k / 32 * block bytes], as `GGUFReader` gives them)."""
    size, values = KEPT[kind]
    n = raw.shape[0]
    blocks = torch.from_numpy(np.array(raw).reshape(n, -1, size))  # a copy: the file is mapped read-only
    d = blocks[..., :2].contiguous().view(torch.float16).reshape(n, -1)
    qs = blocks[..., 2:].contiguous().reshape(n, -1)
    return Blocks(kind, qs.view(torch.int8) if kind == "Q8_0" else qs, d)


def probes(shape: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """(each weight's row, each weight's column) as float32 arrays of `shape` (exact below 2^24)."""
    n, k = shape
    rows = np.repeat(np.arange(n, dtype=np.float32)[:, None], k, axis=1)
    cols = np.repeat(np.arange(k, dtype=np.float32)[None, :], n, axis=0)
    return rows, cols


def moved(row_out, col_out, shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(input rows, input blocks) that the transform's outputs of `probes(shape)` are made of, or None where
    they are not whole rows and whole blocks of the input (values changed, columns mixed within a block, ...)."""
    r, c = torch.as_tensor(row_out), torch.as_tensor(col_out)
    n, k = shape
    if r.dim() != 2 or r.shape != c.shape or r.shape[1] % BLOCK or not r.dtype.is_floating_point:
        return None
    rows, cols = r[:, 0], c[0]
    if not (torch.equal(r, rows[:, None].expand_as(r)) and torch.equal(c, cols[None].expand_as(c))):
        return None
    if not (torch.equal(rows, rows.round()) and torch.equal(cols, cols.round())):
        return None
    if rows.numel() and (rows.min() < 0 or rows.max() >= n or cols.min() < 0 or cols.max() >= k):
        return None
    cols = cols.long().reshape(-1, BLOCK)
    starts = cols[:, 0]
    if not (torch.equal(cols, starts[:, None] + torch.arange(BLOCK)) and bool((starts % BLOCK == 0).all())):
        return None
    return rows.long(), starts // BLOCK

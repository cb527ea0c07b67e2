"""Linear layers: bfloat16 weights packed once for oneDNN (`pack`), and skinny float32 rows for a decode batch. For a few dozen rows, MKL's x @ W^T with row-major float32 weights
is slower than the same product taken as (W @ x^T)^T (`benchmarks/bench_kernels.py --micro` times both); a batched decode step runs
one row per request through every layer. The result is returned as that transposed view (rows stay
contiguous among themselves, so every reshape the models do still works): making it contiguous cost a
quarter of the product.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from .seam import active

SKINNY_ROWS = range(13, 49)  # rows for which (W @ x^T)^T beats F.linear on the CPUs measured


PACKED = "_hyserve_packed"  # the module attribute holding its weight in oneDNN's layout


def pack(module: torch.nn.Linear) -> bool:
    """Keep a bfloat16 weight also in oneDNN's blocked layout, reordered once. `F.linear` on bfloat16 runs the
    same oneDNN product but reorders the weight on every call: a decode step (one row) then streamed the
    weights at about a third of the memory bandwidth the packed product reaches, the 248k-row head of a
    Qwen3.5 included (`benchmarks/bench_kernels.py --micro`). The results are bit-identical to `F.linear`'s.
    The plain weight stays (tied embeddings, transformers' own functions), so weights take twice the memory;
    `HYSERVE_PACKED_LINEAR=0` switches this off. Returns whether the module is packed."""
    if (module.weight.dtype != torch.bfloat16 or module.weight.device.type != "cpu"
            or os.environ.get("HYSERVE_PACKED_LINEAR", "1") == "0" or not torch.backends.mkldnn.is_available()):
        return False
    try:
        setattr(module, PACKED, torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), 1))
    except (RuntimeError, AttributeError):  # a CPU or build without oneDNN's bfloat16 products
        return False
    return True


def unpack(module: torch.nn.Linear) -> None:
    module.__dict__.pop(PACKED, None)


def linear_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """`nn.Linear.forward`, except on the model thread: a packed bfloat16 weight (`pack`) runs its product
    without reordering, and a skinny float32 CPU input takes the faster product order."""
    packed = self.__dict__.get(PACKED)
    if packed is not None and x.dtype == torch.bfloat16 and x.device.type == "cpu" and active():
        return torch.ops.mkldnn._linear_pointwise(x, packed, self.bias, "none", [], "")
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if rows in SKINNY_ROWS and x.dtype == torch.float32 and x.device.type == "cpu" and active():
        y = torch.mm(self.weight, x.reshape(rows, x.shape[-1]).t()).t()
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)  # a transposed view: see the module docstring
    return F.linear(x, self.weight, self.bias)




def probe(linear: torch.nn.Linear, seed: int = 0) -> torch.Tensor:
    """A skinny input of `linear`'s own width for the load-time check."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(SKINNY_ROWS.start + 3, linear.in_features, generator=g).to(linear.weight)

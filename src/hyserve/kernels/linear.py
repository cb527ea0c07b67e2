"""Linear layers for a decode batch. For a few dozen rows, MKL's x @ W^T with row-major float32 weights
is slower than the same product taken as (W @ x^T)^T (`benchmarks/bench_kernels.py --micro` times both); a batched decode step runs
one row per request through every layer. The result is returned as that transposed view (rows stay
contiguous among themselves, so every reshape the models do still works): making it contiguous cost a
quarter of the product.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .seam import active

SKINNY_ROWS = range(13, 49)  # rows for which (W @ x^T)^T beats F.linear on the CPUs measured


def linear_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """`nn.Linear.forward`, except that a skinny float32 CPU input on the model thread takes the faster
    product order."""
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

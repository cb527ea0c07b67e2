"""int8 weights as GGUF's Q8_0 holds them: one float16 scale per block of 32 weights along the input dimension,
symmetric (no zero point), values in [-127, 127]. A Q8_0 block is (d: float16, qs: 32 x int8); here the qs of a
weight [n, k] are one int8 tensor [n, k] and the d one float16 tensor [n, k / 32], so a GGUF file's Q8_0 blocks
can be held as they are (split, not re-quantized) and a weight quantized here is bit for bit what llama.cpp's
`quantize_row_q8_0_ref` makes of it.

The modules hold the quantized form only (no float copy of the weight): a decode step's few rows run the C
product over it (`native.Q8Products`, once checked at load), anything else dequantizes and multiplies in the
activation's dtype (`dequantized_linear`), a slice of output rows at a time so that a 248k-row head never
holds a whole float copy.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels.seam import active

BLOCK = 32
CHUNK = 1 << 22  # weights dequantized at once by `dequantized_linear` (16 MiB in float32)


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(qs int8 [n, k], d float16 [n, k / 32]) of a float weight [n, k], k a multiple of 32, as ggml's
    `quantize_row_q8_0_ref` makes them: d = max|w| / 127 over the block in float32, q = roundf(w * (1 / d))
    (halves away from zero), d stored as float16."""
    n, k = weight.shape
    w = weight.detach().float().reshape(n, k // BLOCK, BLOCK)
    d = w.abs().amax(-1) / 127
    inv = torch.where(d == 0, torch.zeros((), dtype=torch.float32), 1 / d)
    x = (w * inv[..., None]).double()  # roundf, exactly: |x| + 0.5 is exact in float64
    q = (x.sign() * (x.abs() + 0.5).floor()).clamp_(-127, 127).to(torch.int8)
    return q.reshape(n, k), d.to(torch.float16)


def dequantize(qs: torch.Tensor, d: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The float weight [n, k] in `dtype`: q * d in float32 (exact), rounded once."""
    n, k = qs.shape
    return (qs.reshape(n, k // BLOCK, BLOCK).float() * d.float()[..., None]).reshape(n, k).to(dtype)


def dequantized_linear(x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ W^T (+ bias) with W dequantized to x's dtype: the reference every quantized product is checked
    against, and the prefill path."""
    n, k = qs.shape
    step = max(1, CHUNK // k)
    if n <= step:
        return F.linear(x, dequantize(qs, d, x.dtype), bias)
    parts = [F.linear(x, dequantize(qs[a:a + step], d[a:a + step], x.dtype), None if bias is None else bias[a:a + step])
             for a in range(0, n, step)]
    return torch.cat(parts, dim=-1)


class Q8Linear(torch.nn.Module):
    """An `nn.Linear` whose weight is held as Q8_0 values (`quantize`), computing in `dtype` (the model's)."""

    def __init__(self, qs: torch.Tensor, d: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype):
        super().__init__()
        self.out_features, self.in_features = qs.shape
        self.register_buffer("qs", qs)
        self.register_buffer("d", d)
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach(), requires_grad=False)
        self.dtype = dtype
        self.native = None  # `native.Q8Products`, set once the load-time check passed

    @classmethod
    def of(cls, linear: torch.nn.Linear) -> "Q8Linear":
        return cls(*quantize(linear.weight), linear.bias, linear.weight.dtype)

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weight, made on each access and not kept: for code that reads `.weight` (its dtype,
        its device); products run over the int8 values."""
        return dequantize(self.qs, self.d, self.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native is not None and active() and (y := self.native(x, self)) is not None:
            return y
        return dequantized_linear(x, self.qs, self.d, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, q8_0, {self.dtype}"


class Q8Embedding(torch.nn.Module):
    """An `nn.Embedding` held as Q8_0 values: a lookup dequantizes only the rows it reads."""

    def __init__(self, qs: torch.Tensor, d: torch.Tensor, dtype: torch.dtype):
        super().__init__()
        self.num_embeddings, self.embedding_dim = qs.shape
        self.register_buffer("qs", qs)
        self.register_buffer("d", d)
        self.dtype = dtype

    @property
    def weight(self) -> torch.Tensor:
        """As `Q8Linear.weight`: made on access, not kept."""
        return dequantize(self.qs, self.d, self.dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        q, d = F.embedding(ids, self.qs), F.embedding(ids, self.d)
        shape = (*ids.shape, self.embedding_dim // BLOCK, BLOCK)
        return (q.reshape(shape).float() * d.float()[..., None]).reshape(*ids.shape, self.embedding_dim).to(self.dtype)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, q8_0, {self.dtype}"

"""A GGUF file's quantized tensors held as the file's own blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K):
`GgmlLinear` and `GgmlEmbedding` keep a weight [n, k] as n rows of blocks, bytes exactly as in the file.

What users download are mostly K-quant files (Q4_K_M is Q4_K and Q6_K tensors, often with Q5_0 / Q8_0 ones);
dequantized at load they take 4-8x the file's memory and stream that every token, re-quantized they lose quality a
second time. Held as blocks they take the file's size, and `ggml_products.c` multiplies over them with the
activations rounded to Q8_0 blocks (as llama.cpp rounds them, at finer blocks for the K-quants: 32, not 256).

The reference every product is checked against (and the path when the C product is off) is `reference_linear`:
x rounded to Q8_0 blocks (`layout.round_activations`) times the weight dequantized in float32 exactly as gguf-py's
`dequantize` does (`dequantize`: the C form, bit for bit gguf-py's, or gguf-py itself without a C compiler). The C
product is used for every row count, so a token's numbers do not depend on its prefill piece (cache on == cache
off).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels.seam import active
from .layout import CHUNK, round_activations

# ggml type name -> (format code in ggml_products.c, weights a block, bytes a block)
TYPES = {
    "Q4_0": (0, 32, 18),
    "Q4_1": (1, 32, 20),
    "Q5_0": (2, 32, 22),
    "Q5_1": (3, 32, 24),
    "Q8_0": (4, 32, 34),
    "Q4_K": (5, 256, 144),
    "Q5_K": (6, 256, 176),
    "Q6_K": (7, 256, 210),
}


# Values per block of the activations' rounding: 256 (llama.cpp's Q8_K) for the K-quants, whose products then sum
# a super-block in integers and take one float multiply-add per 256 weights; 32 (Q8_0) for the others
ACTIVATION_BLOCK = {kind: 256 if weights == 256 else 32 for kind, (_, weights, _) in TYPES.items()}


def row_bytes(kind: str, k: int) -> int:
    _, weights, size = TYPES[kind]
    return k // weights * size


def dequantize(blocks: torch.Tensor, kind: str, k: int) -> torch.Tensor:
    """Rows of blocks [n, row_bytes] (uint8) -> float32 [n, k], bit for bit gguf-py's `dequantize`."""
    from . import ggml_library

    n = blocks.shape[0]
    out = torch.empty(n, k, dtype=torch.float32)
    lib, _ = ggml_library.library()
    if n and lib is not None and blocks.is_contiguous():
        code = lib.ggml_dequantize(TYPES[kind][0], n, k, blocks.data_ptr(), blocks.shape[1], out.data_ptr())
        if code == 0:
            return out
    if n:
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize as gguf_dequantize

        out.copy_(torch.from_numpy(gguf_dequantize(blocks.numpy(), GGMLQuantizationType[kind]).reshape(n, k)))
    return out


def reference_linear(
    x: torch.Tensor, blocks: torch.Tensor, kind: str, bias: torch.Tensor | None, rounded: bool = True
) -> torch.Tensor:
    """x rounded to Q8_0 blocks (Q8_K's 256 for a K-quant; `rounded`, else as it is), times the dequantized weight
    in float32 (a slice of rows at a time, `CHUNK`: a 248k-row head never makes a whole float copy), plus the bias,
    rounded once to x's dtype."""
    k = x.shape[-1]
    xf = round_activations(x, ACTIVATION_BLOCK[kind]) if rounded else x.float()
    step = max(1, CHUNK // k)
    parts = []
    for a in range(0, blocks.shape[0], step):
        w = dequantize(blocks[a : a + step], kind, k)
        parts.append(F.linear(xf, w, None if bias is None else bias[a : a + step].float()))
    return torch.cat(parts, dim=-1).to(x.dtype)


class GgmlLinear(torch.nn.Module):
    """An `nn.Linear` whose weight is a GGUF file's blocks of one type (`TYPES`), computing in `dtype`."""

    linear_like = True  # the lean decode layers take it as they take an `nn.Linear` (`kernels.decode_layer`)

    def __init__(
        self,
        blocks: torch.Tensor,
        kind: str,
        k: int,
        bias: torch.Tensor | None,
        dtype: torch.dtype,
        input_order: torch.Tensor | None = None,
    ):
        """`input_order`: the file's column of each of the layer's input columns, where the converter reordered
        them within blocks (then each input is put in the file's order before the product: a gather of one row
        of activations, not a float copy of the weight)."""
        super().__init__()
        if blocks.shape[1] != row_bytes(kind, k):
            raise ValueError(f"{kind} rows of {k} weights take {row_bytes(kind, k)} bytes, not {blocks.shape[1]}")
        self.kind, self.in_features, self.out_features = kind, k, blocks.shape[0]
        self.register_buffer("blocks", blocks)
        self.gather = None if input_order is None else torch.argsort(input_order)  # file column -> input column
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach(), requires_grad=False)
        self.dtype = dtype
        self.native = None  # `ggml_native.GgmlProducts`, set once the load-time check passed
        # its input rounded to Q8_0 blocks, as llama.cpp computes (the default); False: taken as it is, the
        # reference's numbers (`--quantization int8|int4`, weight-only; and inside `verify.float_activations`)
        self.rounds_activations = True

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weight, made on each access and not kept (for code that reads its dtype or device)."""
        w = dequantize(self.blocks, self.kind, self.in_features)
        return (w if self.gather is None else w[:, torch.argsort(self.gather)]).to(self.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gather is not None:
            x = x.index_select(-1, self.gather)
        if self.native is not None and active() and (y := self.native(x, self)) is not None:
            return y
        return reference_linear(x, self.blocks, self.kind, self.bias, self.rounds_activations)

    def c_product(self):
        """Its C product as C code calls it (`kernels.native.CProduct`), or None (also where inputs are reordered)."""
        form = getattr(self.native, "c_form", None)
        return form(self) if form is not None and self.gather is None else None

    def extra_repr(self) -> str:
        a8 = ", int8 activations" if self.rounds_activations else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.kind}, {self.dtype}{a8}"


class GgmlEmbedding(torch.nn.Module):
    """An `nn.Embedding` held as a GGUF file's blocks: a lookup dequantizes only the rows it reads."""

    def __init__(self, blocks: torch.Tensor, kind: str, k: int, dtype: torch.dtype):
        super().__init__()
        self.kind, self.num_embeddings, self.embedding_dim = kind, blocks.shape[0], k
        self.register_buffer("blocks", blocks)
        self.dtype = dtype

    @property
    def weight(self) -> torch.Tensor:
        return dequantize(self.blocks, self.kind, self.embedding_dim).to(self.dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.blocks[ids.reshape(-1)]
        return dequantize(rows, self.kind, self.embedding_dim).to(self.dtype).view(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.kind}, {self.dtype}"


def held_layers(model) -> list[GgmlLinear]:
    return [m for m in model.modules() if isinstance(m, GgmlLinear)]


def take_activations_as_they_are(model) -> int:
    """Weight-only products for every `GgmlLinear` of `model` (`--quantization int8|int4` on a GGUF file): the
    activations not rounded, so that the numbers are the dequantized weights' (transformers' loading the same
    file). Returns how many layers."""
    layers = held_layers(model)
    for m in layers:
        m.rounds_activations = False
    return len(layers)


def nbytes(model) -> int:
    """Bytes of every block held (linear layers and embeddings; a tied head's once)."""
    seen = {}
    for m in model.modules():
        if isinstance(m, (GgmlLinear, GgmlEmbedding)):
            seen[m.blocks.data_ptr()] = m.blocks.numel()
    return sum(seen.values())

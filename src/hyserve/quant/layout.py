"""Weights as GGUF's Q8_0 and Q4_0 blocks hold them, and a 6-bit Q6_0 for w4a8's head: one float16 scale `d` per
block of 32 weights along the input dimension, no zero point.

- int8, Q8_0: a block is (d, 32 x int8 in [-127, 127]); here the values of a weight [n, k] are one int8 tensor
  [n, k] and the scales one float16 tensor [n, k / 32].
- int4, Q4_0: a block is (d, 16 bytes): byte i holds weight i in its low nibble and weight 16 + i in its high
  one, a nibble u standing for u - 8; here one uint8 tensor [n, k / 2] of those bytes, block after block.
- int6, Q6_0 (w4a8's head): ik_llama.cpp's 6-bit blocks of 32 (d = the weight of largest magnitude / -32, a 6-bit u
  standing for u - 32), its bytes laid out for the AVX2 product, which then unpacks a block in fewer instructions:
  byte i < 16 holds weight i's 6 bits and weight 16 + i's top two (bits 6-7), bytes 16-23 the low nibbles of
  weights 16-23 (low) and 24-31 (high). One uint8 tensor [n, k * 3 / 4]. As fine as llama.cpp's Q6_K head (6.5 bits
  a weight against 6.56), and its block of 32 fits every width Q8_0 fits (Q6_K's of 256 does not).

The bytes a block takes say which (`format_of`). A GGUF file's Q8_0 / Q4_0 blocks can be held as they are
(split into values and scales, not re-quantized), and a weight quantized here is what ggml's reference
quantizers (`quantize_row_q8_0_ref`, `quantize_row_q4_0_ref`; ik_llama.cpp's `quantize_row_q6_0_ref` for the
values of Q6_0) make of it.

The modules hold the quantized form only (no float copy of the weight): a decode step's few rows run the C
product over it (`native.Products`, once checked at load; under w8a8 / w4a8 every row count runs
`native.A8Products`), anything else dequantizes and multiplies in float32 (`dequantized_linear`), a slice of output
rows at a time so that a 248k-row head never holds a whole float copy.

Under w8a8 / w4a8 the C product reads its weights interleaved (`interleave_`, in place, at load): each set of 8
rows one stretch, block after block, a block's bytes in pieces of 8 taken from 4 rows at a time, as ggml's repacked
Q4_0 x 8 blocks lie. The values and scales keep their shapes and bytes; a module holding them so says it
(`interleaved`), and `dequantize` and the embedding's lookup read them so.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels.linear import GROUP
from ..kernels.seam import active
from .formats import FORMATS

BLOCK = 32
BLOCK_BYTES = {"q8_0": 32, "q4_0": 16, "q6_0": 24}  # the values' bytes of a block of 32 weights
CHUNK = 1 << 22  # weights dequantized at once by `dequantized_linear` (16 MiB in float32)


def quantize(weight: torch.Tensor, scheme: str = "int8") -> tuple[torch.Tensor, torch.Tensor]:
    """(values, d float16 [n, k / 32]) of a float weight [n, k], k a multiple of 32, as ggml makes them; a slice
    of rows at a time (`CHUNK`), so that a 248k-row head needs no whole float32 copy."""
    n, k = weight.shape
    step = max(1, CHUNK // k)
    per_block = BLOCK_BYTES[FORMATS[scheme]]
    qs = torch.empty(n, k // BLOCK * per_block, dtype=torch.int8 if scheme == "int8" else torch.uint8)
    d = torch.empty(n, k // BLOCK, dtype=torch.float16)
    for a in range(0, n, step):  # into the result, not into parts then joined: no second copy of the values
        qs[a : a + step], d[a : a + step] = _quantize(
            weight[a : a + step].detach().float().reshape(-1, k // BLOCK, BLOCK), scheme
        )
    return qs, d


def _quantize(w: torch.Tensor, scheme: str) -> tuple[torch.Tensor, torch.Tensor]:
    n, blocks, _ = w.shape
    if scheme == "int4":
        return _q4_0(w, n, blocks * BLOCK)
    if scheme == "int6":
        return _q6_0(w, n, blocks * BLOCK)
    q, d = _q8_0(w)  # d stored as float16
    return q.to(torch.int8).reshape(n, blocks * BLOCK), d.to(torch.float16)


def _q8_0(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q as float32 in [-127, 127], d float32) of float32 blocks [..., 32]: d = max|x| / 127, q = roundf(x * (1 / d))
    (0 where d is 0), as ggml's `quantize_row_q8_0_ref` before it stores d as float16."""
    d = blocks.abs().amax(-1) / 127
    inv = torch.where(d == 0, torch.zeros((), dtype=torch.float32), 1 / d)
    return _roundf(blocks * inv[..., None]).clamp_(-127, 127), d


def _roundf(x: torch.Tensor) -> torch.Tensor:
    """C's roundf: halves away from zero (torch's round takes them to even), as ggml's quantizers round."""
    t = x.trunc()
    return torch.where((x - t).abs() == 0.5, t + x.sign(), x.round())


def _q4_0(w: torch.Tensor, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_0: d = (the block's weight of largest magnitude, its sign kept) / -8, u = min(15, trunc(w / d + 8.5))
    in float32, two weights to a byte (see the module docstring)."""
    top = w.gather(-1, w.abs().argmax(-1, keepdim=True))[..., 0]  # the first of equal magnitudes, as ggml
    d = top / -8
    inv = torch.where(d == 0, torch.zeros((), dtype=torch.float32), 1 / d)
    u = (w * inv[..., None] + 8.5).floor().clamp_(0, 15).to(torch.uint8)  # >= 0.5 here: trunc is floor
    packed = u[..., : BLOCK // 2] | (u[..., BLOCK // 2 :] << 4)
    return packed.reshape(n, k // 2), d.to(torch.float16)


def _q6_0(w: torch.Tensor, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Q6_0: as Q4_0 with 6 bits, d = (the weight of largest magnitude, its sign kept) / -32 and
    u = min(63, trunc(w / d + 32.5)), laid out as the module docstring says."""
    top = w.gather(-1, w.abs().argmax(-1, keepdim=True))[..., 0]
    d = top / -32
    inv = torch.where(d == 0, torch.zeros((), dtype=torch.float32), 1 / d)
    u = (w * inv[..., None] + 32.5).floor().clamp_(0, 63).to(torch.uint8)
    first, second = u[..., : BLOCK // 2], u[..., BLOCK // 2 :]
    rest = second & 0x0F
    packed = (first | (second >> 4) << 6, rest[..., :8] | rest[..., 8:] << 4)
    return torch.cat(packed, -1).reshape(n, k // BLOCK * BLOCK_BYTES["q6_0"]), d.to(torch.float16)


ORDER = (0, 1, 4, 5, 2, 3, 6, 7)  # a set's rows as an interleaved piece holds them (its own inverse)
PLACES = torch.tensor(ORDER)  # row j's place in its piece: ORDER[j] (a lookup's index, made once)
PIECE = 8  # bytes of a row's block an interleaved piece takes


def _interleaved(qs: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows [8m, ...] of values and scales, interleaved: per set of 8 rows, per block, per piece of 8 bytes of the
    rows' blocks, rows 0, 1, 4, 5 then 2, 3, 6, 7 (the pieces of 4 rows that one load of `a8_products.c` takes,
    ordered so that its sums come out in rows 0-7); the set's scales [blocks, 8]. Same shapes."""
    n, row_bytes = qs.shape
    blocks = d.shape[1]
    q = qs.reshape(n // 8, 8, blocks, row_bytes // blocks // PIECE, PIECE)[:, ORDER]
    q = q.reshape(n // 8, 2, 4, *q.shape[2:]).permute(0, 3, 4, 1, 2, 5)
    return q.reshape(n, row_bytes), d.reshape(n // 8, 8, blocks).transpose(1, 2).reshape(n, blocks)


def _rows(qs: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`_interleaved`'s inverse: values and scales row after row."""
    n, row_bytes = qs.shape
    blocks = d.shape[1]
    q = qs.reshape(n // 8, blocks, row_bytes // blocks // PIECE, 2, 4, PIECE).permute(0, 3, 4, 1, 2, 5)
    q = q.reshape(n // 8, 8, *q.shape[3:])[:, ORDER]
    return q.reshape(n, row_bytes), d.reshape(n // 8, blocks, 8).transpose(1, 2).reshape(n, blocks)


def interleave_(qs: torch.Tensor, d: torch.Tensor, back: bool = False) -> None:
    """Values and scales of n rows (a multiple of 8) interleaved in place (`_interleaved`; `back`: the inverse), a
    slice of sets at a time (`CHUNK`): no second copy of a weight, a shared one (a tied embedding's) changed once."""
    n, k = d.shape[0], d.shape[1] * BLOCK
    step = max(8, CHUNK // k // 8 * 8)
    for a in range(0, n, step):
        q, s = (_rows if back else _interleaved)(qs[a : a + step], d[a : a + step])
        qs[a : a + step], d[a : a + step] = q, s


def interleaved_rows(qs: torch.Tensor, d: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows `ids` (1-D) of interleaved values and scales, row after row: an embedding's lookup."""
    n, row_bytes = qs.shape
    blocks = d.shape[1]
    sets, place = ids // 8, PLACES[ids % 8]
    q = qs.reshape(n // 8, blocks, row_bytes // blocks // PIECE, 2, 4, PIECE)[sets, :, :, place // 4, place % 4]
    return q.reshape(len(ids), row_bytes), d.reshape(n // 8, blocks, 8)[sets, :, ids % 8]


def dequantize(qs: torch.Tensor, d: torch.Tensor, dtype: torch.dtype, interleaved: bool = False) -> torch.Tensor:
    """The float weight [n, k] in `dtype`: value * d in float32 (exact), rounded once. Into one float32 tensor,
    in place: a prefill piece dequantizes every weight it runs through. `interleaved`: qs and d as `interleave_`
    holds them."""
    if interleaved:
        qs, d = _rows(qs, d)
    n, blocks = d.shape
    fmt = format_of(qs, d)
    if fmt == "q6_0":
        q = qs.reshape(n, blocks, BLOCK_BYTES[fmt])
        first, rest, top = q[..., : BLOCK // 2], q[..., BLOCK // 2 :], q[..., : BLOCK // 2] >> 6 << 4
        values = torch.empty(n, blocks, BLOCK, dtype=torch.float32)
        values[..., : BLOCK // 2] = first & 0x3F
        values[..., 16:24] = (rest & 0x0F) | top[..., :8]
        values[..., 24:] = (rest >> 4) | top[..., 8:]
        values.sub_(32)
    elif fmt == "q4_0":
        q = qs.reshape(n, blocks, BLOCK // 2)
        values = torch.empty(n, blocks, BLOCK, dtype=torch.float32)
        values[..., : BLOCK // 2] = q & 0x0F
        values[..., BLOCK // 2 :] = q >> 4
        values.sub_(8)
    else:
        values = qs.reshape(n, blocks, BLOCK).float()
    return values.mul_(d.float()[..., None]).reshape(n, blocks * BLOCK).to(dtype)


def round_activations(x: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """x rounded to Q8_0 blocks along its last dimension and back, in float32: per 32 values (`block`: 256 for
    llama.cpp's Q8_K) d = amax / 127 and q = roundf(x * (1 / d)) (0 where d is 0), then q * d. The float32 operations
    of `a8_products.c`'s `round_rows` (`ggml_products.c`'s `round_rows_k`), so that both round each value alike
    (`--quantization w8a8|w4a8`, a GGUF file's blocks: the activations as llama.cpp rounds them)."""
    shape = x.shape
    q, d = _q8_0(x.float().reshape(-1, shape[-1] // block, block))
    return (q * d[..., None]).reshape(shape)


def dequantized_linear(
    x: torch.Tensor,
    qs: torch.Tensor,
    d: torch.Tensor,
    bias: torch.Tensor | None,
    rounded: bool = False,
    interleaved: bool = False,
) -> torch.Tensor:
    """x @ W^T (+ bias) with W dequantized, in float32 whatever x's dtype, rounded once to x's dtype (`rounded`:
    x first rounded to Q8_0 blocks, `round_activations`): the
    reference every quantized product is checked against, and the prefill path. Not in bfloat16: a bfloat16
    weight cannot hold d * q exactly (up to 18 significant bits), the C product uses the exact weight, and a
    token's result must not depend on which of the two its piece took (a cached turn prefills shorter pieces:
    cache on == cache off). A slice of output rows at a time (`CHUNK`; whole sets of 8 when `interleaved`)."""
    n, k = d.shape[0], d.shape[1] * BLOCK
    xf = round_activations(x) if rounded else x.float()
    bias = None if bias is None else bias.float()
    step = max(8, CHUNK // k // 8 * 8) if interleaved else max(1, CHUNK // k)
    if n <= step:
        return F.linear(xf, dequantize(qs, d, torch.float32, interleaved), bias).to(x.dtype)
    parts = [
        F.linear(
            xf,
            dequantize(qs[a : a + step], d[a : a + step], torch.float32, interleaved),
            None if bias is None else bias[a : a + step],
        ).to(x.dtype)
        for a in range(0, n, step)
    ]
    return torch.cat(parts, dim=-1)


def format_of(qs: torch.Tensor, d: torch.Tensor) -> str:
    """ "q8_0", "q4_0" or "q6_0": the values' bytes per block of 32 weights say which."""
    if qs.dtype == torch.int8:
        return "q8_0"
    return "q6_0" if qs.shape[-1] == d.shape[-1] * BLOCK_BYTES["q6_0"] else "q4_0"


class QuantLinear(torch.nn.Module):
    """An `nn.Linear` whose weight is held as Q8_0, Q4_0 or Q6_0 values (`quantize`), computing in `dtype` (the
    model's). Sibling layers stacked by `siblings.group` hold views of the stack and run its product."""

    linear_like = True  # the lean decode layers take it as they take an `nn.Linear` (`kernels.decode_layer`)

    def __init__(self, qs: torch.Tensor, d: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype):
        super().__init__()
        self.out_features, self.in_features = d.shape[0], d.shape[1] * BLOCK
        self.register_buffer("qs", qs)
        self.register_buffer("d", d)
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach(), requires_grad=False)
        self.dtype = dtype
        self.native = None  # `native.Products`, set once the load-time check passed
        self.rounds_activations = False  # w8a8 / w4a8: its input rounded to Q8_0 blocks (`round_activations`)
        self.interleaved = False  # qs and d as `interleave_` holds them (the C product with int8 activations)

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weight, made on each access and not kept: for code that reads `.weight` (its dtype,
        its device); products run over the int8 values."""
        return dequantize(self.qs, self.d, self.dtype, self.interleaved)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        siblings = self.__dict__.get(GROUP)
        if siblings is not None and active():
            return siblings.output(self, x)
        return self.own(x)

    def own(self, x: torch.Tensor) -> torch.Tensor:
        """Its own product, not its sibling group's: the C product where it applies, else the reference."""
        if self.native is not None and active() and (y := self.native(x, self)) is not None:
            return y
        return dequantized_linear(x, self.qs, self.d, self.bias, self.rounds_activations, self.interleaved)

    def c_product(self):
        """Its C product as C code calls it (`kernels.native.CProduct`), where that is `a8_products.c`'s: else None."""
        form = getattr(self.native, "c_form", None)
        return form(self) if form is not None and self.rounds_activations else None

    def extra_repr(self) -> str:
        a8 = ", int8 activations" if self.rounds_activations else ""
        a8 += ", interleaved" if self.interleaved else ""
        shape = f"in_features={self.in_features}, out_features={self.out_features}"
        return f"{shape}, {format_of(self.qs, self.d)}, {self.dtype}{a8}"


class QuantEmbedding(torch.nn.Module):
    """An `nn.Embedding` held as Q8_0, Q4_0 or Q6_0 values: a lookup dequantizes only the rows it reads."""

    def __init__(self, qs: torch.Tensor, d: torch.Tensor, dtype: torch.dtype):
        super().__init__()
        self.num_embeddings, self.embedding_dim = d.shape[0], d.shape[1] * BLOCK
        self.register_buffer("qs", qs)
        self.register_buffer("d", d)
        self.dtype = dtype
        self.interleaved = False  # the values of a head tied to it, interleaved (`interleave_`)

    @property
    def weight(self) -> torch.Tensor:
        """As `QuantLinear.weight`: made on access, not kept."""
        return dequantize(self.qs, self.d, self.dtype, self.interleaved)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        qs, d = interleaved_rows(self.qs, self.d, flat) if self.interleaved else (self.qs[flat], self.d[flat])
        return dequantize(qs, d, self.dtype).view(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {format_of(self.qs, self.d)}, {self.dtype}"

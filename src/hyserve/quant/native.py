"""The C products over Q8_0, Q4_0 (and, with int8 activations, Q6_0) weights, built at load with the machine's
compiler as `kernels.native` builds `decode_step.c` (same flags, cache folder, OpenMP guard and `HYSERVE_NATIVE=0`
switch), then checked on every weight shape of the model against `dequantized_linear`; off, with the reason, when
they cannot be built or do not match:
- `products.c` (`Products`): weight-only schemes (int8, int4), a decode step's few rows, activations as they are;
- `a8_products.c` (`A8Products`): w8a8 / w4a8, every row count, activations rounded to Q8_0 blocks and multiplied
  in integers. Off, the layers compute the same rounding in PyTorch (`dequantized_linear(rounded=True)`)."""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from ..kernels import linear, native, verify
from .experts import quantized_linears
from .layout import QuantEmbedding, QuantLinear, dequantized_linear, format_of, interleave_

SOURCE = Path(__file__).with_name("products.c")
ISAS = ("portable C", "AVX2", "AVX512F")
A8_SOURCE = Path(__file__).with_name("a8_products.c")
A8_ISAS = ("portable C, int8 activations", "AVX2, int8 activations")
A8_KERNEL = "native_a8"  # the kernel report's name of the products with int8 activations


@functools.lru_cache(maxsize=1)
def library() -> tuple[ctypes.CDLL | None, str]:
    return load(SOURCE)


def load(source: Path) -> tuple[ctypes.CDLL | None, str]:
    """(`source` built and its functions typed, "") or (None, why not); `library` for `SOURCE`, the tests and
    the kernel benchmark for builds of another instruction set (`-DPRODUCTS_ISA`, as a first line)."""
    lib, why = native.build(source)
    if lib is not None:
        # the products and the per-output loops they are checked against (`q*_reference`), one signature
        for f in (lib.q8_products, lib.q4_products, lib.q8_reference, lib.q4_reference):
            f.argtypes = [ctypes.c_int] * 3 + [ctypes.c_void_p, ctypes.c_long] + [ctypes.c_void_p] * 3 + [ctypes.c_int]
            f.restype = ctypes.c_int
        for f in (lib.q8_linear, lib.q4_linear):
            f.argtypes = [ctypes.c_int] * 3 + [ctypes.c_void_p, ctypes.c_long, ctypes.c_int] + [ctypes.c_void_p] * 4
            f.argtypes += [ctypes.c_int]
            f.restype = ctypes.c_int
        lib.q8_isa.restype = ctypes.c_int
    return lib, why


@functools.lru_cache(maxsize=1)
def a8_library() -> tuple[ctypes.CDLL | None, str]:
    return load_a8(A8_SOURCE)


def load_a8(source: Path) -> tuple[ctypes.CDLL | None, str]:
    """As `load`, for `a8_products.c` (`-DA8_ISA` as a first line builds another instruction set)."""
    lib, why = native.build(source)
    if lib is not None:
        lib.a8_linear.argtypes = [ctypes.c_int] * 4 + [ctypes.c_void_p, ctypes.c_long, ctypes.c_int]
        lib.a8_linear.argtypes += [ctypes.c_void_p] * 4 + [ctypes.c_int]
        lib.a8_linear.restype = ctypes.c_int
        lib.round_rows.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_long, ctypes.c_int]
        lib.round_rows.argtypes += [ctypes.c_void_p] * 3
        lib.round_rows.restype = ctypes.c_int
        lib.a8_isa.restype = ctypes.c_int
    return lib, why


def load_isa(isa: int, folder: Path) -> tuple[ctypes.CDLL | None, str]:
    """`load` of `SOURCE` for the instruction set `ISAS[isa]` (at most the CPU's), from a copy written into
    `folder`: for the tests, which check every instruction set this CPU runs."""
    source = folder / f"products_isa{isa}.c"
    source.write_text(f"#define PRODUCTS_ISA {isa}\n{SOURCE.read_text()}")
    return load(source)


class Products:
    """x @ W^T (+ bias) for a few rows (`ROWS`: a decode batch of the default `--max-running`) over a
    `QuantLinear`'s values of one format (`layout.format_of`), in C: the weight streamed as it is held, not
    dequantized first."""

    ROWS = 8

    def __init__(self, lib, fmt: str):
        self.format = fmt
        self.product = lib.q4_products if fmt == "q4_0" else lib.q8_products
        self.linear = lib.q4_linear if fmt == "q4_0" else lib.q8_linear
        self.isa = ISAS[lib.q8_isa()]

    # Weights smaller than this (in weights) take one thread: a parallel region waits for every thread it opens,
    # and on a busy machine that wait, not the product, was most of a tiny model's step. Each output row is one
    # thread's work either way, so the results do not change.
    ONE_THREAD_BELOW = 1 << 18

    def __call__(self, x: torch.Tensor, layer: QuantLinear) -> torch.Tensor | None:
        """[..., k] -> [..., n] in x's dtype, or None (nothing done) for inputs of another form."""
        if x.is_cpu and x.dtype in DIRECT:
            return self._direct(x, layer)
        return self._converted(x, layer)

    def _direct(self, x: torch.Tensor, layer: QuantLinear) -> torch.Tensor | None:
        """`q*_linear`: x read and y written in their dtype by the C code, the bias added there (one C call, no
        conversions in PyTorch); bit for bit `_converted`."""
        held = held_args(layer)
        k, threads = held[4], held[5]
        rows = x.numel() // k if k and x.shape[-1] == k else 0
        if not 0 < rows <= self.ROWS:
            return None
        return _linear_call(self.linear, (), x, rows, held, threads or torch.get_num_threads())

    def _converted(self, x: torch.Tensor, layer: QuantLinear) -> torch.Tensor | None:
        """Other dtypes: x converted to float32 in PyTorch, the product, the bias, y converted back."""
        k = x.shape[-1]
        rows = x.numel() // k if k else 0
        if not (
            0 < rows <= self.ROWS
            and k == layer.in_features
            and x.is_floating_point()
            and x.device.type == "cpu"
            and format_of(layer.qs, layer.d) == self.format
        ):
            return None
        flat = x.reshape(rows, k).float().contiguous()  # a few rows: the copy costs nothing next to the weight
        n = layer.out_features
        y = torch.empty(rows, n, dtype=torch.float32)
        if (
            self.product(
                rows,
                n,
                k,
                flat.data_ptr(),
                k,
                layer.qs.data_ptr(),
                layer.d.data_ptr(),
                y.data_ptr(),
                torch.get_num_threads() if n * k >= self.ONE_THREAD_BELOW else 1,
            )
            != 0
        ):
            return None
        if layer.bias is not None:
            y += layer.bias.float()
        return y.to(x.dtype).view(*x.shape[:-1], n)


def _linear_call(fn, lead: tuple, x: torch.Tensor, rows: int, held: tuple, threads: int) -> torch.Tensor | None:
    """One C linear call (`q*_linear`, `a8_linear` after its `lead` arguments) on x's `rows` rows, into a new y in x's
    dtype; None when the C code refused. `held`: the layer's `held_args`. A decode step makes about a hundred of
    these calls: the work in Python around each is kept to a few tensor queries."""
    n, k, pointers = held[3], held[4], held[6]
    if x.is_contiguous():
        x_ptr, stride = x.data_ptr(), k
    else:
        flat = x.reshape(rows, k)
        if flat.stride(-1) != 1:
            flat = flat.contiguous()
        x_ptr, stride = flat.data_ptr(), flat.stride(0)
    y = torch.empty(x.shape[:-1] + (n,), dtype=x.dtype)
    code = fn(*lead, rows, n, k, x_ptr, stride, x.dtype == torch.bfloat16, *pointers, y.data_ptr(), threads)
    return y if code == 0 else None


def every_row_call(fn, code: int, x: torch.Tensor, held: tuple) -> torch.Tensor | None:
    """`fn` (`a8_linear`, or `ggml_products.c`'s `ggml_linear`: one argument list) of format `code` on all of x's
    rows, the threads by `Products.ONE_THREAD_BELOW`; None for inputs of another dtype or device. `held`: the layer's
    held arguments (`held_args`)."""
    n, k = held[3], held[4]
    if not (x.dtype in DIRECT and x.shape[-1] == k and x.is_cpu and x.numel()):
        return None
    rows = x.numel() // k
    threads = torch.get_num_threads() if rows * n * k >= Products.ONE_THREAD_BELOW else 1
    return _linear_call(fn, (code,), x, rows, held, threads)


def held_args(layer: QuantLinear) -> tuple:
    """(qs, d, bias as float32 or None, n, k, threads: 0 for all, or 1 below `Products.ONE_THREAD_BELOW` weights,
    the pointers of qs, d and bias, the format's code in `a8_linear`), kept on the layer once made (the tensors with
    them, so that the pointers passed stay theirs); both kinds of products read them."""
    held, buffers = layer.__dict__.get("c_args"), layer._buffers  # (the buffers' dict: `layer.qs` costs a lookup chain)
    if held is None or held[0] is not buffers["qs"] or held[1] is not buffers["d"]:
        bias = None if layer.bias is None else layer.bias.detach().float().contiguous()
        n, k = layer.out_features, layer.in_features
        pointers = (layer.qs.data_ptr(), layer.d.data_ptr(), None if bias is None else bias.data_ptr())
        code = A8_FORMATS[format_of(layer.qs, layer.d)] + (INTERLEAVED if layer.interleaved else 0)
        held = (layer.qs, layer.d, bias, n, k, 0 if n * k >= Products.ONE_THREAD_BELOW else 1, pointers, code)
        layer.__dict__["c_args"] = held
    return held


class A8Products:
    """x @ W^T (+ bias) with x rounded to Q8_0 blocks (`a8_products.c`), any number of rows, either format: what
    `dequantized_linear(x, ..., rounded=True)` computes, up to float32 rounding, each row alone."""

    # Rows it takes in one call: all of them. A prefill piece's integer products beat dequantizing the weight and
    # multiplying in float32 (`bench_quant.py --a8-kernels`), and one product for every row count keeps a token's
    # numbers the same whichever piece it is in (cache on == cache off).
    ROWS = 1 << 30

    def __init__(self, lib):
        self.lib = lib
        self.isa = A8_ISAS[lib.a8_isa()]

    def __call__(self, x: torch.Tensor, layer: QuantLinear) -> torch.Tensor | None:
        """[..., k] -> [..., n] in x's dtype, or None (nothing done) for inputs of another dtype or device."""
        held = held_args(layer)
        return every_row_call(self.lib.a8_linear, held[7], x, held)

    def c_form(self, layer: QuantLinear) -> native.CProduct:
        """`layer`'s product as C code calls it (`kernels.native`'s fused decode layers): `a8_linear`'s address and
        the arguments this call passes it, the threads chosen by the same rule."""
        held = held_args(layer)
        address = ctypes.cast(self.lib.a8_linear, ctypes.c_void_p).value
        return native.CProduct(address, held[7], held[3], held[4], *held[6], Products.ONE_THREAD_BELOW, held)


DIRECT = (torch.float32, torch.bfloat16)  # activation dtypes `q*_linear` reads and writes itself
KERNELS = {"q8_0": "native_int8", "q4_0": "native_int4"}  # the kernel report's name of each format's product
A8_FORMATS = {"q8_0": 0, "q4_0": 1, "q6_0": 2}  # `a8_linear`'s code of each format held row after row,
INTERLEAVED = 3  # plus this for one held interleaved (`layout.interleave_`)


def kernel_names(model) -> set[str]:
    """The kernel report's names of the C products `model`'s quantized weights take (`A8_KERNEL` for all of
    them under w8a8 / w4a8)."""
    layers = quantized_linears(model)
    if any(m.rounds_activations for m in layers):
        return {A8_KERNEL}
    return {KERNELS[format_of(m.qs, m.d)] for m in layers}


def install(model, dtype: torch.dtype) -> dict[str, str]:
    """Give the `QuantLinear`s of `model` of each format the C product of that format once it matches
    `dequantized_linear` on each of their weight shapes, for one row and for `ROWS`. Returns, per kernel name
    (`KERNELS`) of the formats present, "" when on, else why not. Under w8a8 / w4a8, `A8Products` for every
    layer, under `A8_KERNEL`."""
    layers = quantized_linears(model)
    if any(m.rounds_activations for m in layers):
        lib, why = a8_library()
        if lib is None:
            return {A8_KERNEL: why}
        interleaved = _interleave(model, layers)
        # one row, a decode batch and a short piece's rows (tiles of 8 and a rest)
        if why := _install(A8Products(lib), layers, dtype, (1, 8, 19), True):
            _interleave(model, interleaved, back=True)
        return {A8_KERNEL: why}
    formats = {fmt: [m for m in layers if format_of(m.qs, m.d) == fmt] for fmt in KERNELS}
    formats = {fmt: group for fmt, group in formats.items() if group}
    lib, why = library()
    if lib is None:
        return {KERNELS[fmt]: why for fmt in formats}
    return {KERNELS[fmt]: _install(Products(lib, fmt), group, dtype) for fmt, group in formats.items()}


def _interleave(model, layers: list[QuantLinear], back: bool = False) -> list[QuantLinear]:
    """Interleave the values of `layers` whose rows are whole sets of 8 (`layout.interleave_`, in place), for
    `a8_products.c`'s faster product over them, and mark an embedding that shares them (a tied head's); `back`:
    undo it. Sibling projections (`linear.SIBLINGS`) are interleaved all or none, so that they still stack
    (`siblings.group`: one held order a stack). Returns the layers changed."""
    left = {id(m) for m in layers if m.out_features % 8 or not m.qs.is_contiguous()}
    for parent in model.modules():
        for names in linear.SIBLINGS:
            members = [getattr(parent, n, None) for n in names]
            if any(id(m) in left for m in members):
                left.update(id(m) for m in members)
    changed = [m for m in layers if m.interleaved == back and id(m) not in left]
    done = set()  # the values of layers that share them are changed once
    for m in changed:
        if (m.qs.data_ptr(), m.d.data_ptr()) not in done:
            interleave_(m.qs, m.d, back)
            done.add((m.qs.data_ptr(), m.d.data_ptr()))
        m.interleaved = not back
        m.__dict__.pop("c_args", None)  # (`held_args`: the format's code changed)
    shared = {m.qs.data_ptr(): m.qs.shape for m in changed}
    for e in model.modules():
        if isinstance(e, QuantEmbedding) and shared.get(e.qs.data_ptr()) == e.qs.shape:
            e.interleaved = not back
    return changed


def _install(
    products: Products | A8Products,
    layers: list[QuantLinear],
    dtype: torch.dtype,
    rows: tuple[int, ...] = (1, Products.ROWS),
    rounded: bool = False,
) -> str:
    """Give `layers` `products` once it matches `dequantized_linear` (`rounded`: of the input rounded to Q8_0
    blocks) on each of their weight shapes and formats, for each row count of `rows`; "" when on, else why not."""
    g = torch.Generator().manual_seed(0)
    shapes = {}
    for layer in layers:
        key = (layer.out_features, layer.in_features, layer.bias is not None, format_of(layer.qs, layer.d))
        shapes.setdefault((*key, layer.interleaved), layer)
    for layer in shapes.values():
        for n in rows:
            x = torch.randn(n, 1, layer.in_features, generator=g).to(dtype)
            with torch.inference_mode():
                got = products(x, layer)
                want = dequantized_linear(x, layer.qs, layer.d, layer.bias, rounded, layer.interleaved)
            if got is None:
                return "does not apply to this model's weights"
            if why := verify.mismatch(got, want, dtype):
                return why
    for layer in layers:
        layer.native = products
    return ""

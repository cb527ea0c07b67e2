"""`ggml_products.c` built at load (after `a8_products.c`, in one unit: it reuses that file's rounding of the
activations to Q8_0 blocks), and `GgmlProducts`, the C product of every `ggml_blocks.GgmlLinear`, switched on
only once it matches `ggml_blocks.reference_linear` on each of the model's weight shapes and types."""

from __future__ import annotations

import ctypes

import torch

from ..kernels import native, verify
from .ggml_blocks import TYPES, GgmlLinear, held_layers, reference_linear
from .ggml_library import library
from .native import Products, every_row_call

KERNEL = "native_ggml"  # the kernel report's name of the products over a GGUF file's blocks
ISAS = ("portable C", "AVX2")


def held_args(layer: GgmlLinear) -> tuple:
    """(blocks, None, bias as float32 or None, n, k, threads: 0 for all or 1 for a small weight, the pointers of the
    blocks, nothing and the bias, the format's code), kept on the layer (as `quant.native.held_args`)."""
    held = layer.__dict__.get("c_args")
    if held is None or held[0] is not layer._buffers["blocks"]:
        bias = None if layer.bias is None else layer.bias.detach().float().contiguous()
        n, k = layer.out_features, layer.in_features
        pointers = (layer.blocks.data_ptr(), None, None if bias is None else bias.data_ptr())
        threads = 0 if n * k >= Products.ONE_THREAD_BELOW else 1
        held = (layer.blocks, None, bias, n, k, threads, pointers, TYPES[layer.kind][0])
        layer.__dict__["c_args"] = held
    return held


class GgmlProducts:
    """x @ W^T (+ bias) over a `GgmlLinear`'s blocks with x rounded to Q8_0 blocks, any number of rows."""

    ROWS = 1 << 30  # every row count (see the module docstring of `ggml_blocks`)

    def __init__(self, lib):
        self.lib = lib
        self.isa = ISAS[lib.a8_isa()]

    def __call__(self, x: torch.Tensor, layer: GgmlLinear) -> torch.Tensor | None:
        held = held_args(layer)
        return every_row_call(self.lib.ggml_linear, _code(layer, held), x, held)

    def c_form(self, layer: GgmlLinear) -> native.CProduct:
        """`layer`'s product as C code calls it (`kernels.native`'s fused decode layers)."""
        held = held_args(layer)
        address = ctypes.cast(self.lib.ggml_linear, ctypes.c_void_p).value
        code = _code(layer, held)
        return native.CProduct(address, code, held[3], held[4], *held[6], Products.ONE_THREAD_BELOW, held)


AS_IS = 16  # added to a format's code: the activations taken as they are (`ggml_products.c`'s G_FLOAT)


def _code(layer: GgmlLinear, held: tuple) -> int:
    return held[7] + (0 if layer.rounds_activations else AS_IS)


def install(model, dtype: torch.dtype) -> dict[str, str]:
    """Give every `GgmlLinear` of `model` the C product once it matches `reference_linear` on each of their
    (shape, type, bias, activations rounded or not) for 1, 8 and 19 rows: {KERNEL: "" when on, else why not};
    {} without such layers."""
    layers = held_layers(model)
    if not layers:
        return {}
    lib, why = library()
    if lib is None:
        return {KERNEL: why}
    products = GgmlProducts(lib)
    g = torch.Generator().manual_seed(0)
    shapes = {(m.out_features, m.in_features, m.kind, m.bias is not None, m.rounds_activations): m for m in layers}
    for layer in shapes.values():
        for rows in (1, 8, 19):
            x = torch.randn(rows, 1, layer.in_features, generator=g).to(dtype)
            with torch.inference_mode():
                got = products(x, layer)
                want = reference_linear(x, layer.blocks, layer.kind, layer.bias, layer.rounds_activations)
            if got is None:
                return {KERNEL: "does not apply to this model's weights"}
            if why := verify.mismatch(got, want, dtype):
                return {KERNEL: f"{layer.kind} {tuple(layer.blocks.shape)}: {why}"}
    for layer in layers:
        layer.native = products
    return {KERNEL: ""}

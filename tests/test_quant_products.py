"""The C products over Q8_0 / Q4_0 weights (`quant/products.c`) run weight-stationary tiles: each weight block
widened once for up to 8 input rows, a few weight rows side by side. Every output must stay bit for bit what the
per-output loop gave before the tiles (kept as `q8_reference` / `q4_reference`), whatever the number of rows:
that keeps a token's result independent of its batch (batched == single, cache on == cache off). Checked for
each instruction set this CPU runs, and the reference itself pinned to the formula's order by a float32
emulation in numpy (each FMA rounded once)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from hyserve.quant import layout
from hyserve.quant import native as qnative

# (n, k): odd n and n below a tile's 4 weight rows (the one-by-one tail), k from one block to real widths; at
# k 1024 more than 4 rows take k in chunks (products.c's X_FLOATS), 21 weight rows a group of 16 and the rest
SHAPES = [(37, 160), (5, 32), (1, 96), (21, 1024)]
ROW_COUNTS = [*range(1, 9), 13]  # 13: more than one tile of 8 input rows


@pytest.fixture(scope="module")
def builds(tmp_path_factory) -> dict:
    """{instruction set: library} for every instruction set this CPU runs: the native build and those below it
    (`-DPRODUCTS_ISA`)."""
    lib, why = qnative.library()
    assert lib is not None, why
    folder = tmp_path_factory.mktemp("isa")
    out = {}
    for isa in range(lib.q8_isa() + 1):
        built, why = qnative.load_isa(isa, folder)
        assert built is not None, why
        assert built.q8_isa() == isa
        out[qnative.ISAS[isa]] = built
    return out


def _weight(n: int, k: int, scheme: str, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.randn(n, k, generator=g) * 0.05
    w[0, :32] *= 1e-3  # a block whose float16 scale is subnormal
    return layout.quantize(w, scheme)


def _rows(count: int, k: int, g: torch.Generator) -> torch.Tensor:
    """`count` input rows of different magnitudes (one all zero), with a row stride of their own."""
    x = torch.randn(count, k + 7, generator=g) * torch.logspace(-3, 2, count)[:, None]
    x[count // 2] = 0
    return x[:, 3 : 3 + k]


def _run(lib, function: str, scheme: str, qs, d, x: torch.Tensor, threads: int = 2) -> torch.Tensor:
    rows, k = x.shape
    n = d.shape[0]
    y = torch.full((rows, n), float("nan"))
    product = getattr(lib, f"{'q4' if scheme == 'int4' else 'q8'}_{function}")
    assert product(rows, n, k, x.data_ptr(), x.stride(0), qs.data_ptr(), d.data_ptr(), y.data_ptr(), threads) == 0
    return y


def _bits(y: torch.Tensor) -> list[int]:
    return y.contiguous().view(torch.int32).flatten().tolist()


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_every_row_count_gives_the_reference_bit_for_bit(builds, scheme):
    g = torch.Generator().manual_seed(1)
    for isa, lib in builds.items():
        for n, k in SHAPES:
            qs, d = _weight(n, k, scheme, g)
            x = _rows(max(ROW_COUNTS), k, g)
            alone = torch.cat([_run(lib, "products", scheme, qs, d, x[r : r + 1]) for r in range(len(x))])
            for rows in ROW_COUNTS:
                got = _run(lib, "products", scheme, qs, d, x[:rows])
                want = _run(lib, "reference", scheme, qs, d, x[:rows])
                assert torch.isfinite(got).all(), (isa, n, k, rows)
                assert _bits(got) == _bits(want), (isa, n, k, rows)
                assert _bits(got) == _bits(alone[:rows]), (isa, n, k, rows)
            assert _bits(_run(lib, "products", scheme, qs, d, x, threads=1)) == _bits(got), (isa, n, k)


def _fma32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """float32 a * b + c rounded once: the exact sum in float64 (a * b is exact there) rounded to odd, then to
    float32 (53 bits >= 24 + 2, so the double rounding is exact)."""
    p = a.astype(np.float64) * b.astype(np.float64)
    c = np.broadcast_to(c, p.shape).astype(np.float64)
    s = p + c
    t = s - p
    err = (p - (s - t)) + (c - t)  # s + err == p + c exactly (TwoSum)
    even = (s.view(np.int64) & 1) == 0
    s = np.where((err != 0) & even, np.nextafter(s, np.where(err > 0, np.inf, -np.inf)), s)
    return s.astype(np.float32)


def _formula(isa: str, scheme: str, qs, d, x: torch.Tensor) -> np.ndarray:
    """y [rows, n] in each instruction set's order: per block, s = the 32 products summed chunk after chunk of
    `lanes` (the first a plain product, the others FMAs; portable C: one by one from 0, each product and sum
    rounded on its own), acc += scale * s lane-wise (an FMA; portable C: rounded twice), then acc's lanes added
    as the C adds them (AVX512: GCC's `_mm512_reduce_add_ps` tree)."""
    n, blocks = d.shape
    if scheme == "int4":
        q = qs.reshape(n, blocks, 16)
        values = torch.cat([q & 0x0F, q >> 4], dim=-1).float() - 8
    else:
        values = qs.reshape(n, blocks, 32).float()
    w = values.numpy()[None]  # [1, n, blocks, 32]
    xs = x.contiguous().reshape(len(x), 1, blocks, 32).numpy()
    scales = d.float().numpy()[None, :, :, None]  # float16 -> float32 is exact
    lanes = {"AVX512F": 16, "AVX2": 8, "portable C": 1}[isa]
    fused = isa != "portable C"  # products.c never lets the compiler fuse a * b + c
    acc = np.zeros((len(x), n, lanes), dtype=np.float32)
    for b in range(blocks):
        wb, xb = w[:, :, b], xs[:, :, b]
        chunks = [(wb[..., c : c + lanes], xb[..., c : c + lanes]) for c in range(0, 32, lanes)]
        s = chunks[0][0] * chunks[0][1]
        if lanes == 1:
            s = s + np.float32(0)  # s = 0.0f; s += ...: a zero product's sign is lost
        for wc, xc in chunks[1:]:
            s = _fma32(wc, xc, s) if fused else s + wc * xc
        acc = _fma32(scales[:, :, b], s, acc) if fused else acc + scales[:, :, b] * s
    if lanes == 16:
        acc = acc[..., :8] + acc[..., 8:]
    if lanes >= 8:
        h = acc[..., :4] + acc[..., 4:]
        return (h[..., 0] + h[..., 2]) + (h[..., 1] + h[..., 3])
    return acc[..., 0]


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_the_reference_is_the_formula_in_its_order(builds, scheme):
    g = torch.Generator().manual_seed(2)
    for isa, lib in builds.items():
        for n, k in SHAPES:
            qs, d = _weight(n, k, scheme, g)
            x = _rows(3, k, g)
            want = torch.from_numpy(_formula(isa, scheme, qs, d, x))
            assert _bits(_run(lib, "reference", scheme, qs, d, x)) == _bits(want), (isa, n, k)


def test_a_width_that_is_not_whole_blocks_is_refused(builds):
    lib = next(iter(builds.values()))
    qs, d = _weight(3, 64, "int8", torch.Generator().manual_seed(3))
    y = torch.zeros(1, 3)
    x = torch.ones(1, 48)
    for function in (lib.q8_products, lib.q4_products):
        assert function(1, 3, 48, x.data_ptr(), 48, qs.data_ptr(), d.data_ptr(), y.data_ptr(), 2) == -1
    assert not y.any()  # nothing written


@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_layer_call_in_c_is_the_product_rounded_as_torch_rounds(builds, scheme, dtype):
    """`q*_linear` (x read and y written in the activation's dtype, the bias added in C) gives bit for bit what
    the product of x.float() plus the bias, rounded by torch to the dtype, gives (NaN where it gives NaN): strided
    rows, a row of NaN and infinities, one layer with a bias and one without."""
    g = torch.Generator().manual_seed(4)
    fmt = "q4_0" if scheme == "int4" else "q8_0"
    for isa, lib in builds.items():
        products = qnative.Products(lib, fmt)
        for n, k in SHAPES:
            qs, d = _weight(n, k, scheme, g)
            for bias in (None, torch.randn(n, generator=g).to(dtype)):
                layer = layout.QuantLinear(qs, d, bias, dtype)
                for rows in (1, 3, products.ROWS):
                    x = (torch.randn(rows, 1, k + 5, generator=g) * 4).to(dtype)[..., 2 : 2 + k]
                    if rows == 3:
                        x[1, 0, :3] = torch.tensor([float("nan"), float("inf"), -float("inf")])
                    got, want = products._direct(x, layer), products._converted(x, layer)
                    assert got.dtype == dtype and got.shape == want.shape == (rows, 1, n)
                    nan = want.isnan()
                    assert torch.equal(got.isnan(), nan), (isa, n, k, rows)  # torch writes its NaNs two ways
                    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
                    assert torch.equal(got[~nan].view(bits), want[~nan].view(bits)), (isa, n, k, rows, bias is None)
                assert products._direct(torch.zeros(products.ROWS + 1, k, dtype=dtype), layer) is None
                assert products._direct(torch.zeros(1, k + 32, dtype=dtype), layer) is None


def test_the_kernel_benchmark_times_both_sides(tmp_path):
    """benchmarks/bench_quant.py --kernels --quick runs and writes both sides for each format and row count (no
    timing asserts)."""
    out = tmp_path / "kernels.json"
    root = Path(__file__).resolve().parents[1]
    command = [sys.executable, "benchmarks/bench_quant.py", "--kernels", "--quick", "--json", str(out)]
    r = subprocess.run(command, cwd=root, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["isa"] in qnative.ISAS
    assert {(row["format"], row["rows"]) for row in result["rows"]} == {
        (f, rows) for f in ("int8", "int4") for rows in (1, 2, 4, 8)
    }
    assert all(row["before_s"] > 0 and row["after_s"] > 0 for row in result["rows"])


def test_the_decode_benchmark_swaps_both_sides_into_the_model(tmp_path):
    """benchmarks/bench_quant.py --kernels-decode --quick times decode steps with each side (no timing asserts)."""
    out = tmp_path / "decode.json"
    root = Path(__file__).resolve().parents[1]
    command = [sys.executable, "benchmarks/bench_quant.py", "--kernels-decode", "--quick", "--json", str(out)]
    r = subprocess.run(command, cwd=root, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    result = json.loads(out.read_text())
    assert [row["requests"] for row in result["rows"]] == [1, 2]
    assert all(row["before_step_s"] > 0 and row["after_step_s"] > 0 for row in result["rows"])

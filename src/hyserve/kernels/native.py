"""C kernels built at load with the machine's C compiler (`decode_step.c`, for bfloat16 models): a decode
step's products of a few rows with a weight (`Products`), the Gated DeltaNet decode step between its two
products (`GdnStep`), a decode step's attention (`DecodeAttention`) and, over int8-activation quantized
weights (whose products `a8_products.c` builds apart and hands in by address), a decoder layer's MLP block and a
whole Gated DeltaNet layer (`MlpBlock`, `GdnLayer`).

A decode step of a hybrid model runs a few dozen small operations per Gated DeltaNet layer, each paying
its dispatch, and reads each layer's recurrent state from memory six times; in C it is one call per layer
and the state is read twice while it is in the core's cache. PyTorch's CPU flash attention reads a decode
step's KV well below the memory's speed; in C both threads stream it, each over its own stretch of keys. The library is
compiled once per source, compiler and CPU (`-march=native`) into a cache folder (`HYSERVE_NATIVE_CACHE`, default
`~/.cache/hyserve/native`) and loaded with ctypes. Nothing here is trusted unchecked: no compiler, a failed
build or a second OpenMP runtime in the process leaves it off, and the load-time check compares each
kernel against the PyTorch operations it replaces. `HYSERVE_NATIVE=0` switches it off.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import NamedTuple

import torch

log = logging.getLogger("hyserve.kernels")

SOURCE = Path(__file__).with_name("decode_step.c")
FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fopenmp", "-fPIC", "-shared")


def enabled() -> bool:
    return os.environ.get("HYSERVE_NATIVE", "1") != "0"


def _cache_dir() -> Path:
    return Path(os.environ.get("HYSERVE_NATIVE_CACHE") or Path.home() / ".cache" / "hyserve" / "native")


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return "".join(line for line in f if line.startswith(("model name", "flags")))
    except OSError:
        return platform.processor()


def _openmp_runtimes() -> set[str]:
    """The OpenMP runtimes mapped into this process (by file name)."""
    try:
        with open("/proc/self/maps") as f:
            return {Path(line.split()[-1]).name for line in f if "libgomp" in line or "libiomp" in line}
    except OSError:
        return set()


class _GdnStep(ctypes.Structure):
    _fields_ = [(n, ctypes.c_int) for n in ("rows", "hk", "dk", "hv", "dv", "kernel", "state_len", "threads")] + [
        ("mixed", ctypes.c_void_p),
        ("z", ctypes.c_void_p),
        ("b", ctypes.c_void_p),
        ("a", ctypes.c_void_p),
        ("mixed_stride", ctypes.c_long),
        ("z_stride", ctypes.c_long),
        ("b_stride", ctypes.c_long),
        ("a_stride", ctypes.c_long),
        ("conv_state", ctypes.c_void_p),
        ("taps", ctypes.c_void_p),
        ("conv_bias", ctypes.c_void_p),
        ("neg_a", ctypes.c_void_p),
        ("dt_bias", ctypes.c_void_p),
        ("state", ctypes.c_void_p),
        ("norm_weight", ctypes.c_void_p),
        ("norm_eps", ctypes.c_float),
        ("out", ctypes.c_void_p),
    ]


class _Attention(ctypes.Structure):
    _fields_ = (
        [(n, ctypes.c_int) for n in ("rows", "heads", "kv_heads", "dim", "keys", "chunk", "threads")]
        + [
            ("q", ctypes.c_void_p),
            ("q_row", ctypes.c_long),
            ("q_head", ctypes.c_long),
            ("k", ctypes.c_void_p),
            ("v", ctypes.c_void_p),
        ]
        + [(n, ctypes.c_long) for n in ("k_row", "k_head", "k_seq", "v_row", "v_head", "v_seq")]
        + [
            ("mask", ctypes.c_void_p),
            ("m_row", ctypes.c_long),
            ("m_key", ctypes.c_long),
            ("scale", ctypes.c_float),
            ("out", ctypes.c_void_p),
        ]
    )


class _A8Weight(ctypes.Structure):
    _fields_ = [(n, ctypes.c_int) for n in ("fmt", "n", "k")] + [(n, ctypes.c_void_p) for n in ("q", "d", "bias")]


class _Mlp(ctypes.Structure):
    _fields_ = (
        [("linear", ctypes.c_void_p)]
        + [(n, ctypes.c_int) for n in ("rows", "hidden", "inter", "threads")]
        + [("one_thread_below", ctypes.c_long), ("norm_scale", ctypes.c_void_p), ("norm_eps", ctypes.c_float)]
        + [("gate_up", _A8Weight), ("down", _A8Weight), ("gate_at", ctypes.c_int), ("up_at", ctypes.c_int)]
    )


class _GdnLayer(ctypes.Structure):
    _fields_ = (
        [("mlp", _Mlp), ("norm_scale", ctypes.c_void_p), ("norm_eps", ctypes.c_float)]
        + [("in_proj", _A8Weight), ("out_proj", _A8Weight)]
        + [(n, ctypes.c_int) for n in ("mixed_at", "z_at", "b_at", "a_at")]
        + [("gdn", _GdnStep)]
    )


class CProduct(NamedTuple):
    """A quantized layer's C product as C code calls it (`a8_products.c`'s `a8_linear`, at `address`): its
    arguments, and `keep`, the tensors they point into (held as long as this is)."""

    address: int
    fmt: int
    n: int
    k: int
    q: int
    d: int
    bias: int | None
    one_thread_below: int
    keep: tuple


def build(source: Path) -> tuple[ctypes.CDLL | None, str]:
    """(the library built from the C file `source` for this CPU and compiler, cached by their hash, and loaded,
    "") or (None, why not). Also `hyserve.quant`'s products."""
    if not enabled():
        return None, "disabled (HYSERVE_NATIVE=0)"
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        return None, "no C compiler (cc) to build it with"
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        return None, f"the C compiler does not run: {exc}"
    key = hashlib.sha256(b"\0".join([source.read_bytes(), " ".join(FLAGS).encode(), version.encode(), _cpu().encode()]))
    target = _cache_dir() / f"{source.stem}-{key.hexdigest()[:16]}.so"
    if not target.exists():
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
                built = Path(tmp) / target.name
                run = subprocess.run(
                    [compiler, *FLAGS, "-o", str(built), str(source), "-lm"],
                    capture_output=True,
                    text=True,
                    timeout=300,
                )
                if run.returncode != 0:
                    return None, f"the C build failed: {run.stderr.strip()[-300:]}"
                os.replace(built, target)  # atomic: a concurrent loader sees the whole file or none
        except (OSError, subprocess.SubprocessError) as exc:
            return None, f"the C build failed: {exc}"
    before = _openmp_runtimes()
    try:
        lib = ctypes.CDLL(str(target))
    except OSError as exc:
        return None, f"the built library does not load: {exc}"
    if len(after := _openmp_runtimes()) > 1 and after != before:
        return None, f"it brought a second OpenMP runtime into the process ({', '.join(sorted(after))})"
    return lib, ""


@functools.lru_cache(maxsize=1)
def library() -> tuple[ctypes.CDLL | None, str]:
    """(the built library, "") or (None, why not)."""
    lib, why = build(SOURCE)
    if lib is None:
        return None, why
    lib.gdn_step.argtypes = [ctypes.POINTER(_GdnStep)]
    lib.gdn_step.restype = ctypes.c_int
    lib.decode_attention.argtypes = [ctypes.POINTER(_Attention)]
    lib.decode_attention.restype = ctypes.c_int
    lib.products.argtypes = [ctypes.c_int] * 3 + [
        ctypes.c_void_p,
        ctypes.c_long,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int,
    ]
    lib.products.restype = ctypes.c_int
    lib.zero_centered_norm.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p]
    lib.zero_centered_norm.argtypes += [ctypes.c_float, ctypes.c_void_p]
    lib.zero_centered_norm.restype = ctypes.c_int
    lib.mlp_block.argtypes = [ctypes.POINTER(_Mlp), ctypes.c_void_p, ctypes.c_void_p]
    lib.gdn_layer.argtypes = [ctypes.POINTER(_GdnLayer), ctypes.c_void_p, ctypes.c_void_p]
    lib.mlp_block.restype = lib.gdn_layer.restype = ctypes.c_int
    return lib, ""


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class GdnStep:
    """The Gated DeltaNet `layer`'s decode step between its products, in C: called with the in-projection's
    parts (mixed, z, b, a: bfloat16 [rows, 1, width] views with unit column stride) and the layer's conv state
    ([rows, channels, state_len], bfloat16) and recurrent state ([rows, heads, dk, dv], float32), both
    contiguous and updated in place; returns the gated norm's output [rows, 1, heads * dv], or None (nothing
    changed) for inputs of another form."""

    def __init__(self, lib, layer, taps: torch.Tensor, neg_a: torch.Tensor, dt_bias: torch.Tensor):
        self.lib = lib
        self.dims = (layer.num_k_heads, layer.head_k_dim, layer.num_v_heads, layer.head_v_dim)
        self.channels = 2 * layer.key_dim + layer.value_dim
        self.kernel = taps.shape[1]
        # kept here: the struct holds their addresses
        self.taps, self.neg_a, self.dt_bias = (t.contiguous() for t in (taps, neg_a, dt_bias))
        bias = layer.conv1d.bias
        self.conv_bias = None if bias is None else bias.detach().float().contiguous()
        self.norm_weight = layer.norm.weight.detach().contiguous()
        eps = getattr(layer.norm, "variance_epsilon", getattr(layer.norm, "eps", None))
        self.ok = (
            self.norm_weight.dtype == torch.bfloat16
            and isinstance(eps, float)
            and self.taps.shape[0] == self.channels
            and layer.num_v_heads % layer.num_k_heads == 0
        )
        hk, dk, hv, dv = self.dims
        self.args = _GdnStep(
            hk=hk,
            dk=dk,
            hv=hv,
            dv=dv,
            kernel=self.kernel,
            taps=_ptr(self.taps),
            conv_bias=_ptr(self.conv_bias),
            neg_a=_ptr(self.neg_a),
            dt_bias=_ptr(self.dt_bias),
            norm_weight=_ptr(self.norm_weight),
            norm_eps=eps or 0.0,
        )

    def __call__(self, mixed, z, b, a, conv_state, state) -> torch.Tensor | None:
        rows = mixed.shape[0]
        hk, dk, hv, dv = self.dims
        if not (
            self.ok
            and all(
                t.dtype == torch.bfloat16 and t.dim() == 3 and t.shape[1] == 1 and t.stride(-1) == 1
                for t in (mixed, z, b, a)
            )
            and conv_state.dtype == torch.bfloat16
            and conv_state.is_contiguous()
            and conv_state.shape[:2] == (rows, self.channels)
            and conv_state.shape[2] >= self.kernel
            and state.dtype == torch.float32
            and state.is_contiguous()
            and state.shape == (rows, hv, dk, dv)
            and mixed.shape[2] == self.channels
            and z.shape[2] == hv * dv
            and b.shape[2] == a.shape[2] == hv
        ):
            return None
        out = torch.empty(rows, 1, hv * dv, dtype=torch.bfloat16)
        p = self.args
        p.rows, p.state_len, p.threads = rows, conv_state.shape[2], torch.get_num_threads()
        p.mixed, p.z, p.b, p.a = mixed.data_ptr(), z.data_ptr(), b.data_ptr(), a.data_ptr()
        p.mixed_stride, p.z_stride, p.b_stride, p.a_stride = mixed.stride(0), z.stride(0), b.stride(0), a.stride(0)
        p.conv_state, p.state, p.out = conv_state.data_ptr(), state.data_ptr(), out.data_ptr()
        if self.lib.gdn_step(ctypes.byref(p)) != 0:
            raise MemoryError("the native Gated DeltaNet step could not allocate its scratch")
        return out


class DecodeAttention:
    """Attention of one query token per row against grouped KV heads, in C (`decode_attention`): query
    [rows, heads, 1, dim], key and value [rows, kv_heads, keys, dim] (any strides but the last), all bfloat16, a
    boolean mask [rows, 1, 1, keys] or None. Returns [rows, 1, heads, dim], or None (nothing done) for inputs
    of another form. PyTorch's CPU flash kernel reads a decode step's KV at a fraction of the memory's speed,
    and more slowly the longer the context; here both threads stream it, each over its own stretch of keys."""

    def __init__(self, lib):
        self.lib = lib
        self.args = _Attention()

    def __call__(self, query, key, value, mask, scaling=None) -> torch.Tensor | None:
        rows, heads, length, dim = query.shape
        kv_heads, keys = key.shape[1], key.shape[2]
        if not (
            length == 1
            and query.dtype == key.dtype == value.dtype == torch.bfloat16
            and key.shape == value.shape == (rows, kv_heads, keys, dim)
            and heads % kv_heads == 0
            and dim % 8 == 0
            and query.stride(-1) == key.stride(-1) == value.stride(-1) == 1
            and keys > 0
            and (mask is None or (mask.dtype == torch.bool and mask.shape == (rows, 1, 1, keys)))
        ):
            return None
        out = torch.empty(rows, 1, heads, dim, dtype=torch.bfloat16)
        a = self.args
        a.rows, a.heads, a.kv_heads, a.dim, a.keys = rows, heads, kv_heads, dim, keys
        a.chunk, a.threads = min(2048, max(256, -(-keys // 4))), torch.get_num_threads()
        a.q, a.q_row, a.q_head = query.data_ptr(), query.stride(0), query.stride(1)
        a.k, a.k_row, a.k_head, a.k_seq = key.data_ptr(), key.stride(0), key.stride(1), key.stride(2)
        a.v, a.v_row, a.v_head, a.v_seq = value.data_ptr(), value.stride(0), value.stride(1), value.stride(2)
        if mask is None:
            a.mask, a.m_row, a.m_key = None, 0, 0
        else:
            a.mask, a.m_row, a.m_key = mask.data_ptr(), mask.stride(0), mask.stride(3)
        a.scale = dim**-0.5 if scaling is None else float(scaling)
        a.out = out.data_ptr()
        if self.lib.decode_attention(ctypes.byref(a)) != 0:
            raise MemoryError("the native decode attention could not allocate its scratch")
        return out


class Products:
    """x @ W^T for a few bfloat16 rows (`ROWS`) against a row-major bfloat16 weight, in C (`products`): each
    thread streams its own stretch of the weight's rows. oneDNN's product reads a one-row decode step's
    weights well below the memory's speed (`benchmarks/bench_decode_step.py` compares them)."""

    ROWS = 4  # up to this many rows; more take oneDNN's product, which reuses each weight block across rows

    def __init__(self, lib):
        self.lib = lib

    def usable(self) -> bool:
        """Whether this CPU and build run it (AVX512-BF16); a probe of one row."""
        x, w = torch.ones(1, 32, dtype=torch.bfloat16), torch.ones(2, 32, dtype=torch.bfloat16)
        return self(x, w) is not None

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
        """[..., k] x [n, k] -> [..., n], or None (nothing done) for inputs of another form."""
        k = x.shape[-1]
        rows = x.numel() // k if k else 0
        if not (
            0 < rows <= self.ROWS
            and x.dtype == weight.dtype == torch.bfloat16
            and weight.dim() == 2
            and weight.shape[1] == k
            and weight.is_contiguous()
            and x.stride(-1) == 1
        ):
            return None
        flat = x.reshape(rows, k)  # a view for the row layouts decode steps use
        n = weight.shape[0]
        out = torch.empty(*x.shape[:-1], n, dtype=torch.bfloat16)
        if (
            self.lib.products(
                rows, n, k, flat.data_ptr(), flat.stride(0), weight.data_ptr(), out.data_ptr(), torch.get_num_threads()
            )
            != 0
        ):
            return None
        return out


class ZeroCenteredNorm:
    """A zero-centered RMSNorm (`norm.zero_centered`) of a few bfloat16 rows, in C (`zero_centered_norm`): a
    Qwen3.5 decode step runs some 60 norms of one row, each eight PyTorch operations' dispatch for 1,024 values."""

    ROWS = 64  # up to this many rows (a decode batch, a speculation's draft); more take PyTorch's operations

    def __init__(self, lib, scale: torch.Tensor, eps: float):
        self.lib, self.scale, self.eps = lib, scale.float().contiguous(), eps

    def __call__(self, x: torch.Tensor) -> torch.Tensor | None:
        """x [..., n] -> its norm, or None (nothing done) for inputs of another form."""
        n = x.shape[-1]
        rows = x.numel() // n if n else 0
        if not (0 < rows <= self.ROWS and x.dtype == torch.bfloat16 and n == self.scale.numel() and x.stride(-1) == 1):
            return None
        flat = x.reshape(rows, n)
        y = torch.empty(x.shape, dtype=torch.bfloat16)
        args = (flat.data_ptr(), flat.stride(0), self.scale.data_ptr(), self.eps, y.data_ptr())
        self.lib.zero_centered_norm(rows, n, *args)
        return y


def _weight(product: CProduct) -> _A8Weight:
    return _A8Weight(fmt=product.fmt, n=product.n, k=product.k, q=product.q, d=product.d, bias=product.bias)


class MlpBlock:
    """A decoder layer's MLP block for one token per row (its norm, gate and up product, SiLU, down product and
    the residual sum), in C (`mlp_block`) over int8-activation quantized weights: `norm`, the post-attention
    norm's C form (`ZeroCenteredNorm`); `gate_up`, the stacked gate and up product, whose output holds gate at
    columns `gate_at` and up at `up_at`; `down`. Called with the layer's hidden states after the mixer
    (bfloat16 [rows, 1, hidden], contiguous), returns the layer's output, or None (nothing done) for another form."""

    def __init__(self, lib, norm: ZeroCenteredNorm, gate_up: CProduct, down: CProduct, gate_at: int, up_at: int):
        self.lib, self.hidden, self.keep = lib, down.n, (norm, gate_up, down)
        self.args = _Mlp(
            linear=gate_up.address,
            hidden=down.n,
            inter=down.k,
            one_thread_below=gate_up.one_thread_below,
            norm_scale=norm.scale.data_ptr(),
            norm_eps=norm.eps,
            gate_up=_weight(gate_up),
            down=_weight(down),
            gate_at=gate_at,
            up_at=up_at,
        )

    def fits(self, h: torch.Tensor) -> bool:
        return h.dtype == torch.bfloat16 and h.dim() == 3 and h.shape[1:] == (1, self.hidden) and h.is_contiguous()

    def __call__(self, h: torch.Tensor) -> torch.Tensor | None:
        if not self.fits(h):
            return None
        out = torch.empty_like(h)
        m = self.args
        m.rows, m.threads = h.shape[0], torch.get_num_threads()
        if self.lib.mlp_block(ctypes.byref(m), h.data_ptr(), out.data_ptr()) != 0:
            raise MemoryError("the native MLP block could not allocate its scratch")
        return out


class GdnLayer:
    """A Qwen3.5 Gated DeltaNet decoder layer for one token per row, in C (`gdn_layer`) over int8-activation
    quantized weights: the input norm (`norm`, its C form), the stacked in-projection (`in_proj`, its output's
    conv input, z, b and a at the columns `at`), the Gated DeltaNet step (`step`, its `GdnStep`), the
    out-projection, the residual sum and `mlp`'s block. Called with the hidden states (bfloat16 [rows, 1,
    hidden], contiguous) and the layer's conv and recurrent states (as `GdnStep` takes them, updated in place),
    returns the layer's output, or None (nothing changed) for inputs of another form."""

    def __init__(self, lib, norm: ZeroCenteredNorm, in_proj: CProduct, at: tuple, step: GdnStep, out_proj, mlp):
        self.lib, self.step, self.mlp, self.keep = lib, step, mlp, (norm, in_proj, out_proj)
        self.args = _GdnLayer(
            mlp=mlp.args,
            norm_scale=norm.scale.data_ptr(),
            norm_eps=norm.eps,
            in_proj=_weight(in_proj),
            out_proj=_weight(out_proj),
            mixed_at=at[0],
            z_at=at[1],
            b_at=at[2],
            a_at=at[3],
            gdn=step.args,
        )
        _, dk, hv, dv = step.dims
        self.state_shape = (hv, dk, dv)

    def __call__(self, h: torch.Tensor, conv_state: torch.Tensor, state: torch.Tensor) -> torch.Tensor | None:
        rows = h.shape[0]
        if not (
            self.step.ok
            and self.mlp.fits(h)
            and conv_state.dtype == torch.bfloat16
            and conv_state.is_contiguous()
            and conv_state.shape[:2] == (rows, self.step.channels)
            and conv_state.shape[2] >= self.step.kernel
            and state.dtype == torch.float32
            and state.is_contiguous()
            and state.shape[0] == rows
            and state.shape[1:] == self.state_shape
        ):
            return None
        out = torch.empty_like(h)
        a = self.args
        a.mlp.rows, a.mlp.threads = rows, torch.get_num_threads()
        a.gdn.state_len, a.gdn.conv_state, a.gdn.state = conv_state.shape[2], conv_state.data_ptr(), state.data_ptr()
        if self.lib.gdn_layer(ctypes.byref(a), h.data_ptr(), out.data_ptr()) != 0:
            raise MemoryError("the native Gated DeltaNet layer could not allocate its scratch")
        return out

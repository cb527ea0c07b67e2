"""`ggml_products.c` built at load, after `a8_products.c` in one unit (it reuses that file's rounding of the
activations to Q8_0 blocks and its conversions): the library both `ggml_blocks` (dequantization) and `ggml_native`
(the products) call."""

from __future__ import annotations

import ctypes
import functools
import hashlib
from pathlib import Path

from ..kernels import native
from .native import A8_SOURCE

SOURCE = Path(__file__).with_name("ggml_products.c")


def source(isa: int | None = None) -> Path:
    """The one C unit built: `a8_products.c` then `ggml_products.c` (`isa`: `-DA8_ISA` first, for the tests),
    written once into the native cache folder under its content's hash."""
    text = (f"#define A8_ISA {isa}\n" if isa is not None else "") + A8_SOURCE.read_text() + SOURCE.read_text()
    path = native._cache_dir() / f"ggml_products-{hashlib.sha256(text.encode()).hexdigest()[:16]}.c"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(text)
        tmp.replace(path)
    return path


def load(isa: int | None = None) -> tuple[ctypes.CDLL | None, str]:
    """(the built library, its functions typed, "") or (None, why not)."""
    if not native.enabled():
        return None, "disabled (HYSERVE_NATIVE=0)"
    try:
        path = source(isa)
    except OSError as exc:
        return None, f"its source could not be written: {exc}"
    lib, why = native.build(path)
    if lib is not None:
        lib.ggml_linear.argtypes = [ctypes.c_int] * 4 + [ctypes.c_void_p, ctypes.c_long, ctypes.c_int]
        lib.ggml_linear.argtypes += [ctypes.c_void_p] * 4 + [ctypes.c_int]
        lib.ggml_linear.restype = ctypes.c_int
        lib.ggml_dequantize.argtypes = [ctypes.c_int, ctypes.c_long, ctypes.c_int, ctypes.c_void_p, ctypes.c_long]
        lib.ggml_dequantize.argtypes += [ctypes.c_void_p]
        lib.ggml_dequantize.restype = ctypes.c_int
        lib.a8_isa.restype = ctypes.c_int
    return lib, why


@functools.lru_cache(maxsize=1)
def library() -> tuple[ctypes.CDLL | None, str]:
    return load()

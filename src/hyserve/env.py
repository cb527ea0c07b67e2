"""`hyserve env`: the versions hyserve runs on and, for a model, which of its kernels passed the load-time
check. What to paste into a bug report."""

from __future__ import annotations

import platform
from importlib import metadata

from . import gguf

PACKAGES = ("hyserve", "torch", "transformers", "kernels", "tokenizers", "fastapi", "uvicorn", "openai", "gguf")


def versions() -> dict[str, str]:
    out = {"python": platform.python_version(), "platform": platform.platform()}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def report(model_dir: str | None = None, dtype: str = "float32", quantization: str | None = None) -> str:
    lines = [f"{k}: {v}" for k, v in versions().items()]
    if model_dir is not None:
        from .models.runtime import ModelRuntime

        info = gguf.inspect(model_dir) if gguf.is_gguf(model_dir) else None  # parsed once, before loading
        rt = ModelRuntime.load(model_dir, dtype=dtype, device="cpu", quantization=quantization)
        lines.append(f"model: {model_dir} ({rt.model.config.model_type}, {dtype})")
        if info is not None:
            lines.append(
                f"gguf: {info.path.name}, architecture {info.architecture}, tensors {info.describe()}: "
                f"{rt.gguf_tensors.describe()}"
                + (f"; then the float ones quantized ({quantization})" if quantization else "")
            )
        if rt.quantization is not None:
            lines.append(f"quantization: {rt.quantization.describe()}")
            from .quant.layout import QuantLinear

            isa = next((m.native.isa for m in rt.model.modules() if isinstance(m, QuantLinear) and m.native), None)
            lines.append(f"quantized products: {isa or 'dequantized, then the dtype product'}")
        lines += [f"kernel {name}: {status}" for name, status in rt.kernels.status.items()]
        from .models.experts import current
        from .quant import runs_all_experts

        if runs_all_experts(rt.model):  # quantized by --quantization, or a GGUF file's kept as its blocks
            lines.append("experts: hyserve's loop over the quantized experts (quant.experts)")
        elif impl := current(rt.model):
            lines.append(f"experts: {impl}")
    return "\n".join(lines)

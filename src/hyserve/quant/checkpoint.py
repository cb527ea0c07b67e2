"""Checkpoints whose weights are already quantized (a `quantization_config` in config.json: GPTQ, AWQ,
compressed-tensors, FP8 block scales, bitsandbytes, ...): not read yet, so refused at start-up with one line that
names the method, rather than loaded through a path that would dequantize, fail deep in transformers, or serve a
model other than the one on disk."""

from __future__ import annotations

import json
from pathlib import Path


def method_of(model_dir: str | Path) -> str | None:
    """The `quant_method` of the folder's config.json (its text config's too), "unnamed" for a
    quantization_config without one; None for a checkpoint of float weights or a folder without config.json."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    for where in (config, config.get("text_config") or {}):
        for key in ("quantization_config", "compression_config"):
            if isinstance(where.get(key), dict):
                return str(where[key].get("quant_method") or where[key].get("format") or "unnamed")
    return None


def refusal(model_dir: str | Path) -> str | None:
    """The one-line reason a pre-quantized folder is not served, or None."""
    method = method_of(model_dir)
    if method is None:
        return None
    return (
        f"{model_dir} holds weights already quantized (quantization_config method {method!r}), which hyserve "
        "does not read: serve the float (bfloat16/float32) checkpoint, with --quantization int8 or int4 to "
        "quantize it at load, or a GGUF file"
    )

"""Load a checked GGUF file by hyserve's own loader (`loader`), imported only then (torch and the gguf package),
and drop the parsed file after: `file` (which `loader` reads) stays importable without either.

transformers' GGUF loader is no longer used for any architecture: it dequantizes every tensor and reads one file
(no splits). hyserve's loader reads all that `file.supported_architectures` accepts."""

from __future__ import annotations

from pathlib import Path

from .file import _readers


def load(path: Path, dtype, device: str):
    """(model, tokenizer, `loader.Loaded`) from a checked GGUF file (Q8_0 / Q4_0 weights kept quantized where
    they can be, the rest dequantized to `dtype`)."""
    from . import loader

    try:
        return loader.load(path, dtype, device)
    finally:
        _readers.clear()

"""Load a checked GGUF file by the loader that covers its architecture: hyserve's own (`loader`) or
transformers' (kept apart from `file`, which `loader` reads, so the two import in one direction)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from .file import _field, _readers, hyserve_loads, parsed_once, reader


def load(path: Path, dtype, device: str):
    """(model, tokenizer, `loader.Loaded`) from a checked GGUF file: by hyserve's loader (Q8_0 / Q4_0 weights
    kept quantized where they can be) or by transformers' (every tensor dequantized to `dtype`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from . import loader  # torch and the gguf package only when a file is loaded

    if hyserve_loads(_field(reader(path), "general.architecture")):
        try:
            return loader.load(path, dtype, device)
        finally:
            _readers.clear()
    folder, name = str(path.parent), path.name
    with parsed_once(path):
        types = Counter(t.tensor_type.name for t in reader(path).tensors)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype, local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
    return model.to(device).eval(), tokenizer, loader.Loaded(dtype, converted=types)

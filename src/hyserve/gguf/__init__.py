"""GGUF files (llama.cpp, Ollama, LM Studio): `hyserve serve FILE.gguf`.

- `file`: find the file, check its header before any weight is read (`inspect`), and read it once.
- `families/`: one module per architecture family that hyserve loads itself (the hybrid ones: Qwen3.5,
  Qwen3-Next, ...), each undoing what llama.cpp's converter did to the HF checkpoint (see `architectures`).
- `dispatch`: `load`, by hyserve's loader or transformers'.
- `architectures`: the registry of those modules, and the interface each exposes.

Architectures no family module covers (llama, qwen2, qwen3, lfm2) load through transformers' GGUF loader.
"""

from .dispatch import load
from .file import GGUFError, GGUFInfo, gguf_path, inspect, is_gguf, split_parts

__all__ = ["GGUFError", "GGUFInfo", "gguf_path", "inspect", "is_gguf", "load", "split_parts"]

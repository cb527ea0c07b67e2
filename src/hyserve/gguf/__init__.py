"""GGUF files (llama.cpp, Ollama, LM Studio): `hyserve serve FILE.gguf`.

- `file`: find the file, check its header before any weight is read (`inspect`), and read it once.
- `families/`: one module per architecture family (the hybrids: Qwen3.5, Qwen3-Next, ...; the plain attention
  ones: llama, qwen2, qwen3; LFM2), each undoing what llama.cpp's converter did to the HF checkpoint (see
  `architectures`).
- `loader`: hyserve's loader, which keeps Q8_0 / Q4_0 weights as the file's blocks; `dispatch`: `load`.
- `architectures`: the registry of those modules, and the interface each exposes.
"""

from .dispatch import load
from .file import GGUFError, GGUFInfo, gguf_path, inspect, is_gguf, split_parts

__all__ = ["GGUFError", "GGUFInfo", "gguf_path", "inspect", "is_gguf", "load", "split_parts"]

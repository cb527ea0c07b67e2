"""Which module of `hyserve.gguf.families` loads which GGUF architecture.

Each module there covers one family and exposes:

    ARCHITECTURES: dict[str, str]     # GGUF `general.architecture` -> the transformers model_type it loads as
    def config(meta: dict) -> dict    # the file's metadata (key -> python value, and "tensor_shapes": GGUF
                                      # tensor name -> shape in numpy order) -> the HF config.json dict
    def tensors(name: str, array, meta: dict, cfg: dict) -> list[tuple[str, torch.Tensor]]
        # one GGUF tensor (dequantized: a float numpy array in GGUF's shape, i.e. numpy order, the reverse of
        # ggml's `ne`) -> the HF state-dict entries it becomes ([] for a tensor the HF model has no place for).
        # An entry's value is a tensor, or a `Part` where several GGUF tensors make one HF tensor together
        # (Qwen3-Next's in_proj_qkvz from attn_qkv and attn_gate, fused experts from gate and up).

The HF names are those of the model's `state_dict()` (transformers' runtime names: fused experts, not the
per-expert names of older checkpoints). The loader adds what only the tensor list tells: `tie_word_embeddings`
(llama.cpp writes no `output.weight` for a tied head).

`tensors` undoes exactly what llama.cpp's converter (convert_hf_to_gguf.py) did to the HF tensor. Whether a
Q8_0 / Q4_0 tensor can stay quantized is found by the loader, not declared: it runs `tensors` on index arrays
and keeps the file's blocks where the result only moves whole rows and whole 32-wide blocks (`blocks`). So
`tensors` must work on any float array of the tensor's shape, and return a tensor of the array's dtype.

The modules are found by listing the package, so a new family is one new file.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
from dataclasses import dataclass
from types import ModuleType

import torch

from . import families


@dataclass(frozen=True)
class Part:
    """Some slices along `dim` of an HF tensor that other GGUF tensors complete: `data` goes to positions
    `index` (a 1-D index along `dim`) of it."""

    index: torch.Tensor
    dim: int
    data: torch.Tensor


@functools.cache
def modules() -> dict[str, ModuleType]:
    """GGUF architecture -> the family module that loads it."""
    found: dict[str, ModuleType] = {}
    for info in pkgutil.iter_modules(families.__path__):
        module = importlib.import_module(f"{families.__name__}.{info.name}")
        for arch in getattr(module, "ARCHITECTURES", {}):
            if arch in found:
                raise RuntimeError(
                    f"GGUF architecture {arch!r} is claimed by both {found[arch].__name__} and {module.__name__}"
                )
            found[arch] = module
    return found


def model_types() -> dict[str, str]:
    """GGUF architecture -> transformers model_type, for those hyserve loads itself."""
    return {arch: module.ARCHITECTURES[arch] for arch, module in modules().items()}


def module_for(arch: str) -> ModuleType | None:
    return modules().get(arch)

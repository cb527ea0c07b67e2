"""What several family modules read and undo alike: the file's metadata and tensor shapes, and llama.cpp's
rotary permutation of q/k rows. Not a family module (no ARCHITECTURES): the registry skips it."""

from __future__ import annotations

import numpy as np
import torch

from ..file import GGUFError


def arch_value(meta: dict, key: str, default=None):
    """`{general.architecture}.{key}`, or `default` when the file has no such key."""
    return meta.get(f"{meta['general.architecture']}.{key}", default)


def required(meta: dict, key: str):
    value = arch_value(meta, key)
    if value is None:
        raise GGUFError(f"the file's metadata has no {meta['general.architecture']}.{key}")
    return value


def per_layer(value, n_layers: int) -> list:
    """A per-layer metadata value: llama.cpp writes one number for all layers or an array of one per layer."""
    return list(value) if isinstance(value, (list, tuple)) else [value] * n_layers


def has(meta: dict, name: str, default: bool) -> bool:
    """Whether the file holds tensor `name`; `default` when the loader passed no tensor list."""
    shapes = meta.get("tensor_shapes")
    return default if shapes is None else name in shapes


def vocab_size(meta: dict) -> int:
    """The embedding's rows: the converter pads the token list of some families (Mamba2's to a multiple of 8
    or 16), not the tensor."""
    shape = meta.get("tensor_shapes", {}).get("token_embd.weight")
    return int(shape[0]) if shape else len(meta["tokenizer.ggml.tokens"])


def block(name: str) -> tuple[int | None, str]:
    """ "blk.3.ssm_in.weight" -> (3, "ssm_in.weight"); a tensor outside the blocks -> (None, name)."""
    if name.startswith("blk."):
        bid, rest = name[4:].split(".", 1)
        return int(bid), rest
    return None, name


def token_ids(meta: dict) -> dict:
    """The special token ids the file names, as HF config keys."""
    ids = {}
    for hf, key in (("bos_token_id", "bos"), ("eos_token_id", "eos"), ("pad_token_id", "padding")):
        if (value := meta.get(f"tokenizer.ggml.{key}_token_id")) is not None:
            ids[hf] = int(value)
    return ids


def unpermute(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo convert_hf_to_gguf.py's LlamaModel.permute (q/k rows reordered for llama.cpp's rotary layout)."""
    return (
        weight.reshape(n_head, weight.shape[0] // n_head // 2, 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def as_tensor(array) -> torch.Tensor:
    """The loader's array (numpy, of the dequantized tensor or an index probe) as a torch tensor of its dtype."""
    if isinstance(array, torch.Tensor):
        return array
    array = np.ascontiguousarray(array)
    return torch.from_numpy(array if array.flags.writeable else array.copy())  # the file's memory map is read-only

"""What several family modules undo alike: reading the file's metadata and tensor list, llama.cpp's rotary
permutation of q/k rows, and one HF tensor written as several GGUF tensors (`part`, put together by `assemble`).

Not a family module (no ARCHITECTURES): the registry skips it.

The metadata dict a family's `config` reads holds, besides the file's key/value pairs, the key `TENSORS`: GGUF
tensor name -> its shape (numpy order). Some of a config is only in which tensors the file has (an untied
output head, an optional norm or bias, the vocabulary rows when the token list was padded).
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable

import torch

TENSORS = "tensors"  # meta key: GGUF tensor name -> shape (numpy order)
_PART = re.compile(r"^(?P<name>.+)#(?P<index>\d+)/(?P<count>\d+)@(?P<dim>-?\d+)$")


class GGUFContentError(ValueError):
    """A file whose metadata and tensors do not describe one model hyserve can build."""


def arch_value(meta: dict, key: str, default=None):
    """`{general.architecture}.{key}`, or `default` when the file has no such key."""
    return meta.get(f"{meta['general.architecture']}.{key}", default)


def required(meta: dict, key: str):
    value = arch_value(meta, key)
    if value is None:
        raise GGUFContentError(f"the file's metadata has no {meta['general.architecture']}.{key}")
    return value


def per_layer(value, n_layers: int) -> list:
    """A per-layer metadata value: llama.cpp writes one number for all layers or an array of one per layer."""
    return list(value) if isinstance(value, (list, tuple)) else [value] * n_layers


def shapes(meta: dict) -> dict[str, tuple[int, ...]]:
    if TENSORS not in meta:
        raise GGUFContentError(f"the loader must pass the file's tensor shapes as meta[{TENSORS!r}]")
    return {name: tuple(int(d) for d in shape) for name, shape in meta[TENSORS].items()}


def block(name: str) -> tuple[int | None, str]:
    """("blk.3.ssm_in.weight") -> (3, "ssm_in.weight"); a tensor outside the blocks -> (None, name)."""
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


def vocab_and_tie(tensors: dict[str, tuple[int, ...]]) -> dict:
    """The vocabulary size is the embedding's rows (the converter pads the token list, not the tensor); a file
    without `output.weight` ties the head to the embedding."""
    if "token_embd.weight" not in tensors:
        raise GGUFContentError("the file has no token_embd.weight")
    return {"vocab_size": tensors["token_embd.weight"][0], "tie_word_embeddings": "output.weight" not in tensors}


def unpermute(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo convert_hf_to_gguf.py's LlamaModel.permute (q/k rows reordered for llama.cpp's rotary layout)."""
    return (weight.reshape(n_head, weight.shape[0] // n_head // 2, 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def part(name: str, index: int, count: int, dim: int) -> str:
    """The entry name of piece `index` of `count` that, concatenated along `dim`, make HF tensor `name`."""
    return f"{name}#{index}/{count}@{dim}"


def assemble(entries: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """`tensors` results of a whole file -> the HF state dict: pieces (`part`) concatenated in order."""
    state: dict[str, torch.Tensor] = {}
    pieces: dict[str, dict[int, torch.Tensor]] = defaultdict(dict)
    shape_of: dict[str, tuple[int, int]] = {}
    for name, tensor in entries:
        if m := _PART.match(name):
            base, count, dim = m["name"], int(m["count"]), int(m["dim"])
            if shape_of.setdefault(base, (count, dim)) != (count, dim):
                raise GGUFContentError(f"{base} is made of pieces that disagree on their count or dimension")
            pieces[base][int(m["index"])] = tensor
        else:
            state[name] = tensor
    for base, found in pieces.items():
        count, dim = shape_of[base]
        if sorted(found) != list(range(count)):
            raise GGUFContentError(f"{base}: the file has {len(found)} of its {count} pieces")
        state[base] = torch.cat([found[i] for i in range(count)], dim=dim)
    return state

"""What several family modules read and undo alike: the file's metadata and tensor shapes, the names of the
tensors outside the blocks, llama.cpp's rotary permutation of q/k rows and its split of fused gate/up tensors.
Not a family module (no ARCHITECTURES): the registry skips it."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from ..architectures import Part
from ..file import GGUFError


def attention_names(module: str) -> dict[str, str]:
    """llama.cpp's attention tensors within a block -> the HF names under `module` (`self_attn`, `mixer`): q, k, v
    and output projections, weights and biases."""
    hf = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "output": "o_proj"}
    return {f"attn_{g}.{kind}": f"{module}.{h}.{kind}" for kind in ("weight", "bias") for g, h in hf.items()}


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


def hidden_and_heads(meta: dict) -> tuple[int, int]:
    """(hidden size, attention heads)."""
    return int(required(meta, "embedding_length")), int(required(meta, "attention.head_count"))


def kv_heads(meta: dict, n_layers: int) -> list[int]:
    """Each block's key/value heads: 0 in a block without attention (how llama.cpp tells the kinds apart)."""
    return [int(n) for n in per_layer(required(meta, "attention.head_count_kv"), n_layers)]


def rope_parameters(meta: dict, **extra) -> dict:
    """The config's plain rotary embedding, from the file's base frequency."""
    return {"rope_type": "default", "rope_theta": float(arch_value(meta, "rope.freq_base", 10000.0)), **extra}


def expand(inner: int, hidden: int) -> int:
    """A Mamba config's `expand`: the mixer's inner size over the hidden size, which must divide it."""
    if inner % hidden:
        raise GGUFError(f"Mamba inner size {inner} is not a multiple of the hidden size {hidden}")
    return inner // hidden


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


def ssm_biases(meta: dict, bid: int) -> tuple[bool, bool]:
    """(conv1d bias, in/out projection bias) of a Mamba mixer, as block `bid` holds them."""
    return has(meta, f"blk.{bid}.ssm_conv1d.bias", True), has(meta, f"blk.{bid}.ssm_in.bias", False)


def top_names(embed: str, final_norm: str, root: str = "model") -> dict[str, str]:
    """GGUF name -> HF name of the tensors outside the blocks (the embedding, the final norm, the output head):
    each family names its embedding and final norm its own way."""
    return {
        "token_embd.weight": f"{root}.{embed}.weight",
        "output_norm.weight": f"{root}.{final_norm}.weight",
        "output.weight": "lm_head.weight",
    }


InBlock = Callable[[str, str, torch.Tensor, dict], list]  # (HF prefix of the block, GGUF name in it, tensor, cfg)


def tensors_by_block(top: dict[str, str], in_block: InBlock, layers: str = "model.layers"):
    """A family's `tensors`: a tensor outside the blocks renamed by `top`, one of block N handed to `in_block`
    with the prefix `{layers}.N.` and its name within the block."""

    def tensors(name: str, array, meta: dict, cfg: dict) -> list[tuple[str, torch.Tensor | Part]]:
        data = as_tensor(array)
        bid, rest = block(name)
        if bid is None:
            return [(top[name], data)]
        return in_block(f"{layers}.{bid}.", rest, data, cfg)

    return tensors


def half_of(half: int, dim: int, data: torch.Tensor) -> Part:
    """One half (0: the gate's rows, 1: the up projection's) of a fused HF tensor along `dim`, which the
    converter wrote as two tensors."""
    size = data.shape[dim]
    return Part(torch.arange(half * size, (half + 1) * size), dim, data)


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


def unpermute_qk(rest: str, data: torch.Tensor, cfg: dict) -> torch.Tensor:
    """A block's tensor `rest` with q/k rows (weights and biases) back from llama.cpp's rotary layout; the
    others as they are."""
    if rest in ("attn_q.weight", "attn_q.bias"):
        return unpermute(data, cfg["num_attention_heads"])
    if rest in ("attn_k.weight", "attn_k.bias"):
        return unpermute(data, cfg["num_key_value_heads"])
    return data


def as_tensor(array) -> torch.Tensor:
    """The loader's array (numpy, of the dequantized tensor or an index probe) as a torch tensor of its dtype."""
    if isinstance(array, torch.Tensor):
        return array
    array = np.ascontiguousarray(array)
    return torch.from_numpy(array if array.flags.writeable else array.copy())  # the file's memory map is read-only

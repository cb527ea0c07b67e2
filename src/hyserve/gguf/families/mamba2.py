"""Pure Mamba2 GGUF files (`mamba2`: Mamba-Codestral and the like), as llama.cpp's converter writes them
(conversion/mamba.py: Mamba2Model), back to the HF model: only the mixer's steps (`_mamba2`) to undo. The
converter pads the token list to a multiple of 16, not the embedding, whose rows give the vocabulary size."""

from __future__ import annotations

import torch

from ..file import GGUFError
from . import _mamba2
from ._common import as_tensor, block, has, required, token_ids, vocab_size

ARCHITECTURES = {"mamba2": "mamba2"}

_TOP = {
    "token_embd.weight": "backbone.embeddings.weight",
    "output_norm.weight": "backbone.norm_f.weight",
    "output.weight": "lm_head.weight",
}


def config(meta: dict) -> dict:
    hidden = int(required(meta, "embedding_length"))
    ssm = _mamba2.dims(meta)
    if ssm["inner"] % hidden:
        raise GGUFError(f"Mamba inner size {ssm['inner']} is not a multiple of the hidden size {hidden}")
    return {
        "architectures": ["Mamba2ForCausalLM"],
        "model_type": "mamba2",
        "vocab_size": vocab_size(meta),
        "hidden_size": hidden,
        "num_hidden_layers": int(required(meta, "block_count")),
        "layer_norm_epsilon": float(required(meta, "attention.layer_norm_rms_epsilon")),
        "num_heads": ssm["heads"],
        "head_dim": ssm["head_dim"],
        "state_size": ssm["state"],
        "n_groups": ssm["groups"],
        "conv_kernel": ssm["conv"],
        "expand": ssm["inner"] // hidden,
        "use_conv_bias": has(meta, "blk.0.ssm_conv1d.bias", True),
        "use_bias": has(meta, "blk.0.ssm_in.bias", False),
        **token_ids(meta),
    }


def tensors(name: str, array, meta: dict, cfg: dict) -> list[tuple[str, torch.Tensor]]:
    data = as_tensor(array)
    bid, rest = block(name)
    if bid is None:
        return [(_TOP[name], data)]
    prefix = f"backbone.layers.{bid}."
    if rest == "attn_norm.weight":
        return [(prefix + "norm.weight", data)]
    if (mixer := _mamba2.mixer_tensor(rest, data)) is None:
        raise KeyError(name)  # the loader's "has no place in the model"
    return [(prefix + "mixer." + mixer[0], mixer[1])]

"""Pure Mamba2 GGUF files (`mamba2`: Mamba-Codestral and the like), as llama.cpp's converter writes them
(conversion/mamba.py: Mamba2Model), back to the HF model: only the mixer's steps (`_mamba2`) to undo. The
converter pads the token list to a multiple of 16, not the embedding, whose rows give the vocabulary size."""

from __future__ import annotations

import torch

from . import _mamba2
from ._common import expand, required, ssm_biases, tensors_by_block, token_ids, top_names, vocab_size

ARCHITECTURES = {"mamba2": "mamba2"}

_TOP = top_names("embeddings", "norm_f", root="backbone")


def config(meta: dict) -> dict:
    hidden = int(required(meta, "embedding_length"))
    ssm = _mamba2.dims(meta)
    conv_bias, proj_bias = ssm_biases(meta, 0)
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
        "expand": expand(ssm["inner"], hidden),
        "use_conv_bias": conv_bias,
        "use_bias": proj_bias,
        **token_ids(meta),
    }


def _in_block(prefix: str, rest: str, data: torch.Tensor, cfg: dict) -> list:
    if rest == "attn_norm.weight":
        return [(prefix + "norm.weight", data)]
    if (mixer := _mamba2.mixer_tensor(rest, data)) is None:
        raise KeyError(rest)  # the loader's "has no place in the model"
    return [(prefix + "mixer." + mixer[0], mixer[1])]


tensors = tensors_by_block(_TOP, _in_block, layers="backbone.layers")

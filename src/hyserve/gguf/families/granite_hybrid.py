"""Granite 4.0-H GGUF files (`granitehybrid`: GraniteMoeHybrid, MoE or dense), as llama.cpp's converter writes
them (conversion/granite.py: GraniteHybridModel on Mamba2Model and GraniteMoeModel), back to the HF checkpoint.

What the converter did and `tensors` undoes: the Mamba2 mixer's steps (`_mamba2`); q/k rows permuted for
llama.cpp's rotary layout (LlamaModel.permute); the routed experts' fused `input_linear` split into gate and up
along its rows, and the shared MLP's likewise (into `ffn_*_shexp`, or `ffn_gate`/`ffn_up`/`ffn_down` for a dense
model): those come back as pieces of one HF tensor (`_common.part`). Granite's µP multipliers are kept as
metadata (attention.scale, embedding_scale, residual_scale, logit_scale) and go back into the config; whether
attention uses RoPE is `rope.scaling.finetuned` (what llama.cpp's granite-hybrid graph reads).
"""

from __future__ import annotations

import numpy as np
import torch

from . import _mamba2
from ._common import (GGUFContentError, arch_value, block, part, per_layer, required, shapes, token_ids,
                      unpermute, vocab_and_tie)

ARCHITECTURES = {"granitehybrid": "granitemoehybrid"}

_TOP = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}
_LAYER = {  # GGUF name within a block -> HF name within `model.layers.N`, or (HF name, piece, of, dim)
    "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias", "attn_output.bias": "self_attn.o_proj.bias",
    "ffn_gate_inp.weight": "block_sparse_moe.router.layer.weight",
    "ffn_gate_exps.weight": ("block_sparse_moe.input_linear.weight", 0, 2, 1),
    "ffn_up_exps.weight": ("block_sparse_moe.input_linear.weight", 1, 2, 1),
    "ffn_down_exps.weight": "block_sparse_moe.output_linear.weight",
    "ffn_gate_shexp.weight": ("shared_mlp.input_linear.weight", 0, 2, 0),
    "ffn_up_shexp.weight": ("shared_mlp.input_linear.weight", 1, 2, 0),
    "ffn_down_shexp.weight": "shared_mlp.output_linear.weight",
    "ffn_gate.weight": ("shared_mlp.input_linear.weight", 0, 2, 0),  # a dense model's shared MLP
    "ffn_up.weight": ("shared_mlp.input_linear.weight", 1, 2, 0),
    "ffn_down.weight": "shared_mlp.output_linear.weight",
}


def config(meta: dict) -> dict:
    tensors = shapes(meta)
    n_layers = int(required(meta, "block_count"))
    kv = [int(n) for n in per_layer(required(meta, "attention.head_count_kv"), n_layers)]
    types = []
    for i in range(n_layers):
        is_attn, has_ssm = f"blk.{i}.attn_q.weight" in tensors, f"blk.{i}.ssm_in.weight" in tensors
        if is_attn == has_ssm or is_attn != (kv[i] > 0):  # e.g. a folder whose layer_types the converter misread
            raise GGUFContentError(f"block {i}: its tensors ({'attention' if is_attn else 'Mamba'}) and its "
                                   f"metadata (head_count_kv {kv[i]}) disagree on what kind of layer it is")
        types.append("full_attention" if is_attn else "linear_attention")
    if "linear_attention" not in types:
        raise GGUFContentError("a granitehybrid file without Mamba layers")
    hidden, heads = int(required(meta, "embedding_length")), int(required(meta, "attention.head_count"))
    ssm = _mamba2.dims(meta)
    if ssm["inner"] % hidden:
        raise GGUFContentError(f"Mamba inner size {ssm['inner']} is not a multiple of the hidden size {hidden}")
    first_ssm = types.index("linear_attention")
    experts = int(arch_value(meta, "expert_count", 0) or 0)
    shared = next((tensors[f"blk.0.{n}"][0] for n in ("ffn_up_shexp.weight", "ffn_up.weight")
                   if f"blk.0.{n}" in tensors), 0)
    cfg = {
        "architectures": ["GraniteMoeHybridForCausalLM"], "model_type": "granitemoehybrid",
        "hidden_size": hidden, "num_hidden_layers": n_layers, "layer_types": types,
        "num_attention_heads": heads, "num_key_value_heads": max(kv),
        "max_position_embeddings": int(required(meta, "context_length")),
        "rms_norm_eps": float(required(meta, "attention.layer_norm_rms_epsilon")),
        "rope_parameters": {"rope_type": "default", "rope_theta": float(arch_value(meta, "rope.freq_base", 10000.0))},
        "position_embedding_type": "rope" if arch_value(meta, "rope.scaling.finetuned", True) else "nope",
        "attention_bias": any(f"blk.{i}.attn_q.bias" in tensors for i in range(n_layers)),
        "attention_multiplier": float(arch_value(meta, "attention.scale", 1.0)),
        "embedding_multiplier": float(arch_value(meta, "embedding_scale", 1.0)),
        "residual_multiplier": float(arch_value(meta, "residual_scale", 1.0)),
        "logits_scaling": float(arch_value(meta, "logit_scale", 1.0)),
        "num_local_experts": experts,
        "num_experts_per_tok": int(arch_value(meta, "expert_used_count", 0) or 0),
        "intermediate_size": int(tensors[f"blk.0.ffn_up_exps.weight"][1]) if experts
        else int(arch_value(meta, "feed_forward_length", shared) or shared),
        "shared_intermediate_size": int(shared),
        "mamba_n_heads": ssm["heads"], "mamba_d_head": ssm["head_dim"], "mamba_d_state": ssm["state"],
        "mamba_n_groups": ssm["groups"], "mamba_d_conv": ssm["conv"], "mamba_expand": ssm["inner"] // hidden,
        "mamba_conv_bias": f"blk.{first_ssm}.ssm_conv1d.bias" in tensors,
        "mamba_proj_bias": f"blk.{first_ssm}.ssm_in.bias" in tensors,
        **vocab_and_tie(tensors), **token_ids(meta),
    }
    return cfg


def tensors(name: str, array, meta: dict, cfg: dict) -> list[tuple[str, torch.Tensor]]:
    data = torch.from_numpy(np.ascontiguousarray(array))
    bid, rest = block(name)
    if bid is None:
        if name not in _TOP:
            raise GGUFContentError(f"unexpected tensor {name} in a granitehybrid file")
        return [(_TOP[name], data)]
    prefix = f"model.layers.{bid}."
    if (mixer := _mamba2.mixer_tensor(rest, data)) is not None:
        return [(prefix + "mamba." + mixer[0], mixer[1])]
    target = _LAYER.get(rest)
    if target is None:
        raise GGUFContentError(f"unexpected tensor {name} in a granitehybrid file")
    if rest in ("attn_q.weight", "attn_q.bias"):
        data = unpermute(data, cfg["num_attention_heads"])
    elif rest in ("attn_k.weight", "attn_k.bias"):
        data = unpermute(data, cfg["num_key_value_heads"])
    if isinstance(target, tuple):
        hf, index, count, dim = target
        return [(part(prefix + hf, index, count, dim), data)]
    return [(prefix + target, data)]

"""LFM2-MoE GGUF files (`lfm2moe`: LFM2-8B-A1B and the like), as llama.cpp's converter writes them
(conversion/lfm2.py: LFM2MoeModel), back to the HF model. transformers' own GGUF loader reads dense `lfm2` files
only.

What the converter did and `tensors` undoes: the short convolution's weight squeezed from (channels, 1, kernel) to
(channels, kernel); the routed experts stacked into `ffn_{gate,up,down}_exps` (w1, w3, w2), back into
transformers' fused `experts.gate_up_proj` (w1 rows first, then w3) and `experts.down_proj`; the router's
`expert_bias` written as `exp_probs_b.bias`. Nothing is permuted. Attention layers are those with
`head_count_kv` > 0, the first `leading_dense_block_count` blocks have a dense MLP. The router's
`norm_topk_prob` and `routed_scaling_factor` are not in the file: what llama.cpp's graph uses (normalized top-k
weights, scaled by `expert_weights_scale` where the file has it, else 1).
"""

from __future__ import annotations

import torch

from ..file import GGUFError
from ._common import (
    arch_value,
    half_of,
    has,
    kv_heads,
    per_layer,
    required,
    rope_parameters,
    tensors_by_block,
    token_ids,
    vocab_size,
)

ARCHITECTURES = {"lfm2moe": "lfm2_moe"}

_TOP = {
    "token_embd.weight": "model.embed_tokens.weight",
    "token_embd_norm.weight": "model.embedding_norm.weight",  # LFM2's final norm, whatever its name
    "output.weight": "lm_head.weight",
}  # (not `top_names`: the final norm's GGUF name is LFM2's own)
_LAYER = {  # GGUF name within a block -> HF name within `model.layers.N`, or (HF name, which half along dim 1)
    "attn_norm.weight": "operator_norm.weight",
    "ffn_norm.weight": "ffn_norm.weight",
    "shortconv.conv.weight": "conv.conv.weight",
    "shortconv.conv.bias": "conv.conv.bias",
    "shortconv.in_proj.weight": "conv.in_proj.weight",
    "shortconv.in_proj.bias": "conv.in_proj.bias",
    "shortconv.out_proj.weight": "conv.out_proj.weight",
    "shortconv.out_proj.bias": "conv.out_proj.bias",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.out_proj.weight",
    "attn_q_norm.weight": "self_attn.q_layernorm.weight",
    "attn_k_norm.weight": "self_attn.k_layernorm.weight",
    "ffn_gate.weight": "feed_forward.w1.weight",
    "ffn_up.weight": "feed_forward.w3.weight",
    "ffn_down.weight": "feed_forward.w2.weight",
    "ffn_gate_inp.weight": "feed_forward.gate.weight",
    "exp_probs_b.bias": "feed_forward.expert_bias",
    "ffn_gate_exps.weight": ("feed_forward.experts.gate_up_proj", 0),
    "ffn_up_exps.weight": ("feed_forward.experts.gate_up_proj", 1),
    "ffn_down_exps.weight": "feed_forward.experts.down_proj",
}


def config(meta: dict) -> dict:
    n_layers = int(required(meta, "block_count"))
    kv = kv_heads(meta, n_layers)
    types = ["full_attention" if k else "conv" for k in kv]
    if "conv" not in types:
        raise GGUFError("an lfm2moe file without convolution layers")
    dense = int(required(meta, "leading_dense_block_count"))
    if dense >= n_layers:
        raise GGUFError(f"an lfm2moe file whose {n_layers} blocks are all dense (leading_dense_block_count {dense})")
    first_conv = types.index("conv")
    return {
        "architectures": ["Lfm2MoeForCausalLM"],
        "model_type": "lfm2_moe",
        "vocab_size": vocab_size(meta),
        "hidden_size": int(required(meta, "embedding_length")),
        "intermediate_size": int(per_layer(required(meta, "feed_forward_length"), n_layers)[0]),
        "moe_intermediate_size": int(required(meta, "expert_feed_forward_length")),
        "num_hidden_layers": n_layers,
        "layer_types": types,
        "num_attention_heads": int(required(meta, "attention.head_count")),
        "num_key_value_heads": max(kv),
        "max_position_embeddings": int(required(meta, "context_length")),
        "norm_eps": float(required(meta, "attention.layer_norm_rms_epsilon")),
        "rope_parameters": rope_parameters(meta),
        "conv_L_cache": int(required(meta, "shortconv.l_cache")),
        "conv_bias": has(meta, f"blk.{first_conv}.shortconv.in_proj.bias", False),
        "num_dense_layers": dense,
        "num_experts": int(required(meta, "expert_count")),
        "num_experts_per_tok": int(required(meta, "expert_used_count")),
        "use_expert_bias": has(meta, f"blk.{dense}.exp_probs_b.bias", True),
        "norm_topk_prob": bool(arch_value(meta, "expert_weights_norm", True)),
        "routed_scaling_factor": float(arch_value(meta, "expert_weights_scale", 0.0) or 1.0),
        **token_ids(meta),
    }


def _in_block(prefix: str, rest: str, data: torch.Tensor, cfg: dict) -> list:
    target = _LAYER[rest]
    if rest == "shortconv.conv.weight":  # HF (channels, 1, kernel), squeezed to (channels, kernel)
        data = data.unsqueeze(1)
    if isinstance(target, tuple):  # the experts' w1 (gate) rows first, then w3 (up), along dim 1
        hf, half = target
        return [(prefix + hf, half_of(half, 1, data))]
    return [(prefix + target, data)]


tensors = tensors_by_block(_TOP, _in_block)

"""Nemotron-H GGUF files (`nemotron_h`, and `nemotron_h_moe` for the MoE ones such as Nemotron 3 Nano), as
llama.cpp's converter writes them (conversion/nemotron.py: NemotronHModel on GraniteHybridModel), back to the
HF checkpoint (`backbone.*`, one tensor per expert).

What the converter did and `tensors` undoes: the Mamba2 mixer's A_log -> -exp(A_log), D and A to (heads, 1),
conv1d squeezed, the gated norm into groups, dt_bias renamed (`_mamba2`); q/k rows permuted for llama.cpp's
rotary layout (Nemotron-H has no rotary embedding, but the converter permutes anyway); the routed experts
stacked into one tensor each for up and down. The layer pattern is read back from the tensors each block has.
The multi-token-prediction block the converter can append is not loaded (hyserve does not run it).
"""

from __future__ import annotations

import numpy as np
import torch

from . import _mamba2
from ._common import (GGUFContentError, arch_value, block, per_layer, required, shapes, token_ids, unpermute,
                      vocab_and_tie)

ARCHITECTURES = {"nemotron_h": "nemotron_h", "nemotron_h_moe": "nemotron_h"}

_TOP = {"token_embd.weight": "backbone.embeddings.weight", "output_norm.weight": "backbone.norm_f.weight",
        "output.weight": "lm_head.weight"}
_LAYER = {  # GGUF name within a block -> HF name within `backbone.layers.N`
    "attn_norm.weight": "norm.weight",
    "attn_q.weight": "mixer.q_proj.weight", "attn_k.weight": "mixer.k_proj.weight",
    "attn_v.weight": "mixer.v_proj.weight", "attn_output.weight": "mixer.o_proj.weight",
    "attn_q.bias": "mixer.q_proj.bias", "attn_k.bias": "mixer.k_proj.bias",
    "attn_v.bias": "mixer.v_proj.bias", "attn_output.bias": "mixer.o_proj.bias",
    "ffn_up.weight": "mixer.up_proj.weight", "ffn_down.weight": "mixer.down_proj.weight",
    "ffn_up.bias": "mixer.up_proj.bias", "ffn_down.bias": "mixer.down_proj.bias",
    "ffn_gate_inp.weight": "mixer.gate.weight", "exp_probs_b.bias": "mixer.gate.e_score_correction_bias",
    "ffn_up_shexp.weight": "mixer.shared_experts.up_proj.weight",
    "ffn_down_shexp.weight": "mixer.shared_experts.down_proj.weight",
}
_EXPERTS = {"ffn_up_exps.weight": "up_proj.weight", "ffn_down_exps.weight": "down_proj.weight"}


def layer_types(meta: dict, tensors: dict) -> list[str]:
    """Each block's kind, from the tensors it holds (in a `nemotron_h_moe` file a dense MLP block has a zero
    feed_forward_length, so the metadata alone cannot tell it from a Mamba block)."""
    types = []
    for i in range(int(required(meta, "block_count"))):
        if f"blk.{i}.ssm_in.weight" in tensors:
            types.append("linear_attention")
        elif f"blk.{i}.attn_q.weight" in tensors:
            types.append("full_attention")
        elif f"blk.{i}.ffn_up_exps.weight" in tensors:
            types.append("moe")
        elif f"blk.{i}.ffn_up.weight" in tensors:
            types.append("mlp")
        else:
            raise GGUFContentError(f"block {i} has none of a Mamba, attention, MoE or MLP block's tensors")
    return types


def config(meta: dict) -> dict:
    tensors = shapes(meta)
    if arch_value(meta, "nextn_predict_layers"):
        raise GGUFContentError("a Nemotron-H file with its multi-token-prediction block is not supported; "
                               "convert with --no-mtp")
    if arch_value(meta, "moe_latent_size"):
        raise GGUFContentError("Nemotron-H with latent MoE projections (moe_latent_size) is not supported")
    types = layer_types(meta, tensors)
    ssm = _mamba2.dims(meta)
    kv = [int(n) for n in per_layer(required(meta, "attention.head_count_kv"), len(types))]
    mlp = next((tensors[f"blk.{i}.ffn_up.weight"][0] for i, t in enumerate(types) if t == "mlp"), None)
    first_ssm = types.index("linear_attention") if "linear_attention" in types else None
    cfg = {
        "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h",
        "hidden_size": int(required(meta, "embedding_length")), "num_hidden_layers": len(types),
        "layers_block_type": types,
        "num_attention_heads": int(per_layer(required(meta, "attention.head_count"), len(types))[0]),
        "num_key_value_heads": max(kv) or 1,
        "head_dim": int(arch_value(meta, "attention.key_length")
                        or int(required(meta, "embedding_length")) // int(required(meta, "attention.head_count"))),
        "max_position_embeddings": int(required(meta, "context_length")),
        "layer_norm_epsilon": float(arch_value(meta, "attention.layer_norm_epsilon")
                                    or required(meta, "attention.layer_norm_rms_epsilon")),
        "mamba_num_heads": ssm["heads"], "mamba_head_dim": ssm["head_dim"], "ssm_state_size": ssm["state"],
        "n_groups": ssm["groups"], "conv_kernel": ssm["conv"],
        "use_conv_bias": first_ssm is None or f"blk.{first_ssm}.ssm_conv1d.bias" in tensors,
        "use_bias": first_ssm is not None and f"blk.{first_ssm}.ssm_in.bias" in tensors,
        "attention_bias": any(f"blk.{i}.attn_q.bias" in tensors for i in range(len(types))),
        "mlp_bias": any(f"blk.{i}.ffn_up.bias" in tensors for i in range(len(types))),
        "num_nextn_predict_layers": 0,
        **vocab_and_tie(tensors), **token_ids(meta),
    }
    if mlp is not None:
        cfg["intermediate_size"] = int(mlp)
    if "moe" in types:
        cfg.update({
            "n_routed_experts": int(required(meta, "expert_count")),
            "num_experts_per_tok": int(required(meta, "expert_used_count")),
            "moe_intermediate_size": int(required(meta, "expert_feed_forward_length")),
            "moe_shared_expert_intermediate_size": int(required(meta, "expert_shared_feed_forward_length")),
            "n_shared_experts": int(arch_value(meta, "expert_shared_count", 1)),
            "norm_topk_prob": bool(arch_value(meta, "expert_weights_norm", False)),
            "routed_scaling_factor": float(arch_value(meta, "expert_weights_scale", 1.0)),
            "n_group": int(arch_value(meta, "expert_group_count", 1)),
            "topk_group": int(arch_value(meta, "expert_group_used_count", 1)),
        })
    return cfg


def tensors(name: str, array, meta: dict, cfg: dict) -> list[tuple[str, torch.Tensor]]:
    data = torch.from_numpy(np.ascontiguousarray(array))
    bid, rest = block(name)
    if bid is None:
        if name not in _TOP:
            raise GGUFContentError(f"unexpected tensor {name} in a Nemotron-H file")
        return [(_TOP[name], data)]
    if bid >= cfg["num_hidden_layers"]:
        return []  # a multi-token-prediction block (refused in config) has no place in the model
    prefix = f"backbone.layers.{bid}."
    if (mixer := _mamba2.mixer_tensor(rest, data)) is not None:
        return [(prefix + "mixer." + mixer[0], mixer[1])]
    if rest in _EXPERTS:  # stacked (experts, out, in) -> one tensor per expert
        return [(f"{prefix}mixer.experts.{e}.{_EXPERTS[rest]}", data[e]) for e in range(data.shape[0])]
    if rest not in _LAYER:
        raise GGUFContentError(f"unexpected tensor {name} in a Nemotron-H file")
    if rest in ("attn_q.weight", "attn_q.bias"):
        data = unpermute(data, cfg["num_attention_heads"])
    elif rest in ("attn_k.weight", "attn_k.bias"):
        data = unpermute(data, cfg["num_key_value_heads"])
    return [(prefix + _LAYER[rest], data)]

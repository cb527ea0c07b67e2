"""Nemotron-H GGUF files (`nemotron_h`, and `nemotron_h_moe` for the MoE ones such as Nemotron 3 Nano), as
llama.cpp's converter writes them (conversion/nemotron.py: NemotronHModel on GraniteHybridModel), back to the
HF model.

What the converter did and `tensors` undoes: the Mamba2 mixer's A_log -> -exp(A_log), D and A to (heads, 1),
conv1d squeezed, the gated norm into groups, dt_bias renamed (`_mamba2`); q/k rows permuted for llama.cpp's
rotary layout (Nemotron-H has no rotary embedding, but the converter permutes anyway). The routed experts are
stacked as transformers holds them, so they pass as they are. The layer pattern is read back as llama.cpp reads
it: attention where head_count_kv > 0, else an MLP (MoE in `nemotron_h_moe`) where feed_forward_length > 0, else
Mamba2. A multi-token-prediction block is refused (hyserve does not run it; convert with --no-mtp).
"""

from __future__ import annotations

import torch

from ..file import GGUFError
from . import _mamba2
from ._common import (
    arch_value,
    attention_names,
    has,
    kv_heads,
    per_layer,
    required,
    ssm_biases,
    tensors_by_block,
    token_ids,
    top_names,
    unpermute_qk,
    vocab_size,
)

ARCHITECTURES = {"nemotron_h": "nemotron_h", "nemotron_h_moe": "nemotron_h"}

_TOP = top_names("embeddings", "norm_f")
_PROOF = {
    "linear_attention": "ssm_in.weight",
    "full_attention": "attn_q.weight",
    "moe": "ffn_up_exps.weight",
    "mlp": "ffn_up.weight",
}  # a tensor each kind of block has
_LAYER = {  # GGUF name within a block -> HF name within `model.layers.N`
    "attn_norm.weight": "norm.weight",
    **attention_names("mixer"),
    "ffn_up.weight": "mixer.up_proj.weight",
    "ffn_down.weight": "mixer.down_proj.weight",
    "ffn_up.bias": "mixer.up_proj.bias",
    "ffn_down.bias": "mixer.down_proj.bias",
    "ffn_gate_inp.weight": "mixer.gate.weight",
    "exp_probs_b.bias": "mixer.gate.e_score_correction_bias",
    "ffn_up_exps.weight": "mixer.experts.up_proj",
    "ffn_down_exps.weight": "mixer.experts.down_proj",
    "ffn_up_shexp.weight": "mixer.shared_experts.up_proj.weight",
    "ffn_down_shexp.weight": "mixer.shared_experts.down_proj.weight",
}


def layer_types(meta: dict) -> list[str]:
    n_layers = int(required(meta, "block_count"))
    kv = per_layer(required(meta, "attention.head_count_kv"), n_layers)
    ff = per_layer(arch_value(meta, "feed_forward_length", 0), n_layers)
    mlp = "moe" if meta["general.architecture"] == "nemotron_h_moe" else "mlp"
    types = ["full_attention" if kv[i] else mlp if ff[i] else "linear_attention" for i in range(n_layers)]
    for i, t in enumerate(types):  # a dense model converted under transformers 5 is written as nemotron_h_moe
        if not has(meta, f"blk.{i}.{_PROOF[t]}", True):  # with its MLP blocks' width 0: read as Mamba blocks
            raise GGUFError(
                f"block {i}: its metadata makes it a {t} block, but the file has no {_PROOF[t]} there "
                "(a file from a converter that misread the layer pattern?)"
            )
    return types


def config(meta: dict) -> dict:
    if arch_value(meta, "nextn_predict_layers"):
        raise GGUFError(
            "a Nemotron-H file with a multi-token-prediction block is not supported (convert it with --no-mtp)"
        )
    if arch_value(meta, "moe_latent_size"):
        raise GGUFError("Nemotron-H with latent MoE projections (moe_latent_size) is not supported")
    types = layer_types(meta)
    n = len(types)
    hidden, heads = (
        int(required(meta, "embedding_length")),
        int(per_layer(required(meta, "attention.head_count"), n)[0]),
    )
    ff = per_layer(arch_value(meta, "feed_forward_length", 0), n)
    ssm = _mamba2.dims(meta)
    conv_bias, proj_bias = ssm_biases(meta, types.index("linear_attention") if "linear_attention" in types else 0)
    cfg = {
        "architectures": ["NemotronHForCausalLM"],
        "model_type": "nemotron_h",
        "vocab_size": vocab_size(meta),
        "hidden_size": hidden,
        "num_hidden_layers": n,
        "layers_block_type": types,
        "num_attention_heads": heads,
        "num_key_value_heads": max(kv_heads(meta, n)) or 1,
        "head_dim": int(arch_value(meta, "attention.key_length") or hidden // heads),
        "max_position_embeddings": int(required(meta, "context_length")),
        "layer_norm_epsilon": float(
            arch_value(meta, "attention.layer_norm_epsilon") or required(meta, "attention.layer_norm_rms_epsilon")
        ),
        "mamba_num_heads": ssm["heads"],
        "mamba_head_dim": ssm["head_dim"],
        "ssm_state_size": ssm["state"],
        "n_groups": ssm["groups"],
        "conv_kernel": ssm["conv"],
        "use_conv_bias": conv_bias,
        "use_bias": proj_bias,
        "attention_bias": any(has(meta, f"blk.{i}.attn_q.bias", False) for i in range(n)),
        "mlp_bias": any(has(meta, f"blk.{i}.ffn_up.bias", False) for i in range(n)),
        "num_nextn_predict_layers": 0,
        **token_ids(meta),
    }
    if "mlp" in types:
        cfg["intermediate_size"] = int(max(ff))
    if "moe" in types:
        cfg.update(
            {
                "n_routed_experts": int(required(meta, "expert_count")),
                "num_experts_per_tok": int(required(meta, "expert_used_count")),
                "moe_intermediate_size": int(required(meta, "expert_feed_forward_length")),
                "moe_shared_expert_intermediate_size": int(required(meta, "expert_shared_feed_forward_length")),
                "n_shared_experts": int(arch_value(meta, "expert_shared_count", 1)),
                "norm_topk_prob": bool(arch_value(meta, "expert_weights_norm", False)),
                "routed_scaling_factor": float(arch_value(meta, "expert_weights_scale", 1.0)),
                "n_group": int(arch_value(meta, "expert_group_count", 1)),
                "topk_group": int(arch_value(meta, "expert_group_used_count", 1)),
            }
        )
    return cfg


def _in_block(prefix: str, rest: str, data: torch.Tensor, cfg: dict) -> list:
    if (mixer := _mamba2.mixer_tensor(rest, data)) is not None:
        return [(prefix + "mixer." + mixer[0], mixer[1])]
    return [(prefix + _LAYER[rest], unpermute_qk(rest, data, cfg))]


tensors = tensors_by_block(_TOP, _in_block)

"""Granite 4.0-H GGUF files (`granitehybrid`: GraniteMoeHybrid, MoE or dense), as llama.cpp's converter writes
them (conversion/granite.py: GraniteHybridModel on Mamba2Model and GraniteMoeModel), back to the HF model.

What the converter did and `tensors` undoes: the Mamba2 mixer's steps (`_mamba2`); q/k rows permuted for
llama.cpp's rotary layout (LlamaModel.permute); the routed experts' fused `input_linear` split into gate and up
along its rows, and the shared MLP's likewise (into `ffn_*_shexp`, or `ffn_gate`/`ffn_up`/`ffn_down` for a dense
model): those go back as `Part`s of the fused HF tensor. Granite's µP multipliers are kept as
metadata (attention.scale, embedding_scale, residual_scale, logit_scale) and go back into the config; whether
attention uses RoPE is `rope.scaling.finetuned` (what llama.cpp's granite-hybrid graph reads).

Bamba folders (BambaForCausalLM) are written by the same converter class as `granitehybrid` too, and are the only
ones it writes with `rope.scaling.finetuned` true (it writes a Granite 4.0-H without RoPE): such a file loads as
transformers' `bamba` model, which rotates the first half of each head (as every Bamba folder does; the
converter permuted q/k over the whole head, which is undone exactly). Its MLP (`ffn_gate`, `ffn_up`, `ffn_down`)
is Bamba's `feed_forward`, not Granite's fused shared MLP.
"""

from __future__ import annotations

import torch

from ..architectures import Part
from ..file import GGUFError
from . import _mamba2
from ._common import (
    arch_value,
    attention_names,
    expand,
    half_of,
    has,
    hidden_and_heads,
    kv_heads,
    per_layer,
    required,
    rope_parameters,
    ssm_biases,
    tensors_by_block,
    token_ids,
    top_names,
    unpermute_qk,
    vocab_size,
)

ARCHITECTURES = {"granitehybrid": "granitemoehybrid"}

_TOP = top_names("embed_tokens", "norm")
_LAYER = {  # GGUF name within a block -> HF name within `model.layers.N`, or (HF name, which half along dim)
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    **attention_names("self_attn"),
    "ffn_gate_inp.weight": "block_sparse_moe.router.weight",
    "ffn_gate_exps.weight": ("block_sparse_moe.experts.gate_up_proj", 0, 1),
    "ffn_up_exps.weight": ("block_sparse_moe.experts.gate_up_proj", 1, 1),
    "ffn_down_exps.weight": "block_sparse_moe.experts.down_proj",
    "ffn_gate_shexp.weight": ("shared_mlp.input_linear.weight", 0, 0),
    "ffn_up_shexp.weight": ("shared_mlp.input_linear.weight", 1, 0),
    "ffn_down_shexp.weight": "shared_mlp.output_linear.weight",
    "ffn_gate.weight": ("shared_mlp.input_linear.weight", 0, 0),  # a dense model's shared MLP
    "ffn_up.weight": ("shared_mlp.input_linear.weight", 1, 0),
    "ffn_down.weight": "shared_mlp.output_linear.weight",
}


_BAMBA_TOP = top_names("embed_tokens", "final_layernorm")
_BAMBA_LAYER = {
    **{k: v for k, v in _LAYER.items() if k.startswith(("attn_", "ffn_norm"))},
    "ffn_norm.weight": "pre_ff_layernorm.weight",
    "ffn_gate.weight": "feed_forward.gate_proj.weight",
    "ffn_up.weight": "feed_forward.up_proj.weight",
    "ffn_down.weight": "feed_forward.down_proj.weight",
}
# in every Granite 4.0-H file (the converter writes each multiplier the config has), in no Bamba file
_GRANITE_ONLY = ("attention.scale", "embedding_scale", "residual_scale", "logit_scale", "expert_count")


def bamba_config(meta: dict, types: list[str], kv: list[int]) -> dict:
    """The config of a granitehybrid file with RoPE: a Bamba folder's (see the module docstring)."""
    n_layers = len(types)
    hidden, heads = hidden_and_heads(meta)
    head_dim = hidden // heads
    if int(arch_value(meta, "attention.key_length") or head_dim) != head_dim:
        raise GGUFError(f"a Bamba file whose head width is not hidden size / heads ({head_dim})")
    # the converter writes the whole head unless the folder's config names attn_rotary_emb (real Bamba configs
    # do: half); transformers' Bamba rotates half of each head whatever its config says
    rotary = int(arch_value(meta, "rope.dimension_count", head_dim))
    if rotary not in (head_dim // 2, head_dim):
        raise GGUFError(
            f"rotary embedding over {rotary} of the {head_dim} head dimensions: transformers' Bamba rotates "
            f"{head_dim // 2} (half of each head)"
        )
    ssm = _mamba2.dims(meta)
    conv_bias, proj_bias = ssm_biases(meta, types.index("linear_attention"))
    attention = [i for i, t in enumerate(types) if t == "full_attention"]
    return {
        "architectures": ["BambaForCausalLM"],
        "model_type": "bamba",
        "vocab_size": vocab_size(meta),
        "hidden_size": hidden,
        "num_hidden_layers": n_layers,
        "attn_layer_indices": attention,
        "num_attention_heads": heads,
        "num_key_value_heads": max(kv),
        "intermediate_size": int(per_layer(required(meta, "feed_forward_length"), n_layers)[0]),
        "max_position_embeddings": int(required(meta, "context_length")),
        "rms_norm_eps": float(required(meta, "attention.layer_norm_rms_epsilon")),
        "rope_parameters": rope_parameters(meta, partial_rotary_factor=0.5),
        "attention_bias": has(meta, f"blk.{attention[0]}.attn_q.bias", False) if attention else False,
        "mlp_bias": False,
        **_mamba2.mamba_sizes(ssm),
        "mamba_expand": expand(ssm["inner"], hidden),
        "mamba_conv_bias": conv_bias,
        "mamba_proj_bias": proj_bias,
        **token_ids(meta),
    }


def config(meta: dict) -> dict:
    n_layers = int(required(meta, "block_count"))
    kv = kv_heads(meta, n_layers)
    types = ["full_attention" if k else "linear_attention" for k in kv]
    for i, t in enumerate(types):  # a folder whose layer_types the converter misread makes such a file
        if has(meta, f"blk.{i}.attn_q.weight", t == "full_attention") != (t == "full_attention"):
            raise GGUFError(
                f"block {i}: its tensors and its metadata (head_count_kv {kv[i]}) disagree on whether "
                "it is an attention layer (a file from a converter that misread the layer types?)"
            )
    if "linear_attention" not in types:
        raise GGUFError("a granitehybrid file without Mamba layers")
    hidden, heads = hidden_and_heads(meta)
    ssm = _mamba2.dims(meta)
    mamba_expand = expand(ssm["inner"], hidden)
    conv_bias, proj_bias = ssm_biases(meta, types.index("linear_attention"))
    head_dim = int(arch_value(meta, "attention.key_length") or hidden // heads)
    rope = bool(arch_value(meta, "rope.scaling.finetuned", True))
    if rope and not any(arch_value(meta, key) for key in _GRANITE_ONLY):  # as the converter writes a Bamba
        return bamba_config(meta, types, kv)
    if rope and int(arch_value(meta, "rope.dimension_count", head_dim)) != head_dim:
        raise GGUFError(
            f"rotary embedding over {arch_value(meta, 'rope.dimension_count')} of the {head_dim} head "
            "dimensions in a Granite 4.0-H file (with Granite's multipliers or experts) is not supported"
        )
    experts = int(arch_value(meta, "expert_count", 0) or 0)
    ff = int(per_layer(required(meta, "feed_forward_length"), n_layers)[0])
    return {
        "architectures": ["GraniteMoeHybridForCausalLM"],
        "model_type": "granitemoehybrid",
        "vocab_size": vocab_size(meta),
        "hidden_size": hidden,
        "num_hidden_layers": n_layers,
        "layer_types": types,
        "num_attention_heads": heads,
        "num_key_value_heads": max(kv),
        "max_position_embeddings": int(required(meta, "context_length")),
        "rms_norm_eps": float(required(meta, "attention.layer_norm_rms_epsilon")),
        "rope_parameters": rope_parameters(meta),
        "position_embedding_type": "rope" if rope else "nope",
        "attention_bias": has(meta, f"blk.{types.index('full_attention')}.attn_q.bias", False)
        if "full_attention" in types
        else False,
        # absent: llama.cpp scales scores by 1/sqrt(head_dim)
        "attention_multiplier": float(arch_value(meta, "attention.scale") or head_dim**-0.5),
        "embedding_multiplier": float(arch_value(meta, "embedding_scale", 1.0)),
        "residual_multiplier": float(arch_value(meta, "residual_scale", 1.0)),
        "logits_scaling": float(arch_value(meta, "logit_scale", 1.0)),
        "num_local_experts": experts,
        "num_experts_per_tok": int(arch_value(meta, "expert_used_count", 0) or 0),
        "intermediate_size": ff,
        # a dense model's shared MLP is written as the plain FFN, of feed_forward_length
        "shared_intermediate_size": int(arch_value(meta, "expert_shared_feed_forward_length", 0) or 0) or ff,
        **_mamba2.mamba_sizes(ssm),
        "mamba_expand": mamba_expand,
        "mamba_conv_bias": conv_bias,
        "mamba_proj_bias": proj_bias,
        **token_ids(meta),
    }


def _in_block(layer: dict):
    """A block's tensors, named by `layer` (Granite's or Bamba's)."""

    def place(prefix: str, rest: str, data: torch.Tensor, cfg: dict) -> list:
        if (mixer := _mamba2.mixer_tensor(rest, data)) is not None:
            return [(prefix + "mamba." + mixer[0], mixer[1])]
        target, data = layer[rest], unpermute_qk(rest, data, cfg)
        if isinstance(target, tuple):  # gate rows first, then up
            hf, half, dim = target
            return [(prefix + hf, half_of(half, dim, data))]
        return [(prefix + target, data)]

    return place


_GRANITE_TENSORS = tensors_by_block(_TOP, _in_block(_LAYER))
_BAMBA_TENSORS = tensors_by_block(_BAMBA_TOP, _in_block(_BAMBA_LAYER))


def tensors(name: str, array, meta: dict, cfg: dict) -> list[tuple[str, torch.Tensor | Part]]:
    return (_BAMBA_TENSORS if cfg["model_type"] == "bamba" else _GRANITE_TENSORS)(name, array, meta, cfg)

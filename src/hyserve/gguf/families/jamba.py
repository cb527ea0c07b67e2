"""Jamba GGUF files (`jamba`), as llama.cpp's converter writes them (conversion/jamba.py: JambaModel), back to the
HF model.

What the converter did and `tensors` undoes: the Mamba (1) mixer's `A_log` stored as A = -exp(A_log) (back with
log(-a); Jamba's A is (inner, state), not reshaped), its conv1d weight squeezed from (channels, 1, kernel) to
(channels, kernel); the routed experts of each MoE layer stacked into `ffn_{gate,up,down}_exps`, back into
transformers' fused `experts.gate_up_proj` (gate rows first, then up) and `experts.down_proj`. Nothing is permuted
(Jamba has no rotary embedding). The layer pattern is read as llama.cpp reads it: attention where `head_count_kv`
> 0; MoE where the block has `ffn_gate_exps`; both go back into the config as offset and period.
"""

from __future__ import annotations

import torch

from ..file import GGUFError
from ._common import (
    arch_value,
    expand,
    half_of,
    has,
    hidden_and_heads,
    kv_heads,
    per_layer,
    required,
    ssm_biases,
    tensors_by_block,
    token_ids,
    top_names,
    vocab_size,
)

ARCHITECTURES = {"jamba": "jamba"}

_TOP = top_names("embed_tokens", "final_layernorm")
_LAYER = {  # GGUF name within a block -> HF name within `model.layers.N`, or (HF name, which half along dim 1)
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "pre_ff_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ssm_in.weight": "mamba.in_proj.weight",
    "ssm_in.bias": "mamba.in_proj.bias",
    "ssm_conv1d.weight": "mamba.conv1d.weight",
    "ssm_conv1d.bias": "mamba.conv1d.bias",
    "ssm_x.weight": "mamba.x_proj.weight",
    "ssm_dt.weight": "mamba.dt_proj.weight",
    "ssm_dt.bias": "mamba.dt_proj.bias",
    "ssm_dt_norm.weight": "mamba.dt_layernorm.weight",
    "ssm_b_norm.weight": "mamba.b_layernorm.weight",
    "ssm_c_norm.weight": "mamba.c_layernorm.weight",
    "ssm_a": "mamba.A_log",
    "ssm_d": "mamba.D",
    "ssm_out.weight": "mamba.out_proj.weight",
    "ssm_out.bias": "mamba.out_proj.bias",
    "ffn_gate.weight": "feed_forward.gate_proj.weight",
    "ffn_up.weight": "feed_forward.up_proj.weight",
    "ffn_down.weight": "feed_forward.down_proj.weight",
    "ffn_gate_inp.weight": "feed_forward.router.weight",
    "ffn_gate_exps.weight": ("feed_forward.experts.gate_up_proj", 0),
    "ffn_up_exps.weight": ("feed_forward.experts.gate_up_proj", 1),
    "ffn_down_exps.weight": "feed_forward.experts.down_proj",
}


def _offset_period(found: list[int], n_layers: int, what: str) -> tuple[int, int]:
    """(offset, period) with `i % period == offset` exactly for the layers in `found`, as Jamba's config spells a
    layer pattern; refused where no such pair exists."""
    offset = found[0]
    period = found[1] - found[0] if len(found) > 1 else max(n_layers, offset + 1)
    if [i for i in range(n_layers) if i % period == offset] != found:
        raise GGUFError(
            f"the {what} layers {found} are not every n-th layer from an offset, as Jamba's config has them"
        )
    return offset, period


def config(meta: dict) -> dict:
    n_layers = int(required(meta, "block_count"))
    kv = kv_heads(meta, n_layers)
    attention = [i for i, k in enumerate(kv) if k]
    if not attention:
        raise GGUFError("a jamba file without attention layers")
    for i in range(n_layers):  # the metadata and the tensors must agree on which blocks are attention
        if has(meta, f"blk.{i}.attn_q.weight", bool(kv[i])) != bool(kv[i]):
            raise GGUFError(f"block {i}: its tensors and its metadata (head_count_kv {kv[i]}) disagree on its kind")
    attn_offset, attn_period = _offset_period(attention, n_layers, "attention")
    experts = int(arch_value(meta, "expert_count", 0) or 0)
    moe = [i for i in range(n_layers) if has(meta, f"blk.{i}.ffn_gate_exps.weight", experts > 1)]
    if moe and experts > 1:
        expert_offset, expert_period = _offset_period(moe, n_layers, "MoE")
    else:  # no routed experts: every layer a plain MLP
        experts, expert_offset, expert_period = 1, 0, 1
    hidden, heads = hidden_and_heads(meta)
    mamba_expand = expand(int(required(meta, "ssm.inner_size")), hidden)
    if len(attention) == n_layers:
        raise GGUFError("a jamba file without Mamba layers")
    conv_bias, proj_bias = ssm_biases(meta, kv.index(0))
    return {
        "architectures": ["JambaForCausalLM"],
        "model_type": "jamba",
        "vocab_size": vocab_size(meta),
        "hidden_size": hidden,
        "intermediate_size": int(per_layer(required(meta, "feed_forward_length"), n_layers)[0]),
        "num_hidden_layers": n_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": max(kv),
        "max_position_embeddings": int(required(meta, "context_length")),
        "rms_norm_eps": float(required(meta, "attention.layer_norm_rms_epsilon")),
        "attn_layer_offset": attn_offset,
        "attn_layer_period": attn_period,
        "expert_layer_offset": expert_offset,
        "expert_layer_period": expert_period,
        "num_experts": experts,
        "num_experts_per_tok": int(arch_value(meta, "expert_used_count", 1) or 1) if experts > 1 else 1,
        "mamba_d_state": int(required(meta, "ssm.state_size")),
        "mamba_d_conv": int(required(meta, "ssm.conv_kernel")),
        "mamba_expand": mamba_expand,
        "mamba_dt_rank": int(required(meta, "ssm.time_step_rank")),
        "mamba_conv_bias": conv_bias,
        "mamba_proj_bias": proj_bias,
        **token_ids(meta),
    }


def _in_block(prefix: str, rest: str, data: torch.Tensor, cfg: dict) -> list:
    target = _LAYER[rest]
    if rest == "ssm_a":  # A = -exp(A_log), (inner, state) as in HF
        data = torch.log(-data)
    elif rest == "ssm_conv1d.weight":  # HF (channels, 1, kernel), squeezed to (channels, kernel)
        data = data.unsqueeze(1)
    if isinstance(target, tuple):  # the experts' gate rows first, then up, along dim 1
        hf, half = target
        return [(prefix + hf, half_of(half, 1, data))]
    return [(prefix + target, data)]


tensors = tensors_by_block(_TOP, _in_block)

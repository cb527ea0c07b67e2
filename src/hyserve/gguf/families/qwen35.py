"""Qwen3.5 (`qwen35`, and its MoE `qwen35moe`) and Qwen3-Next (`qwen3next`) GGUF files back to the HF checkpoint.

What llama.cpp's converter (conversion/qwen.py: Qwen3NextModel, _LinearAttentionVReorderBase, Qwen3_5TextModel)
(and Qwen3_5MoeTextModel) does, and what is undone here:
- `A_log` -> `ssm_a` = -exp(A_log): back with log(-a);
- `dt_bias` -> `ssm_dt.bias`; conv1d [c, 1, k] -> `ssm_conv1d` [c, k] (squeezed);
- RMSNorm weights, which these models apply as (1 + w), stored as 1 + w, except the Gated DeltaNet's own norm
  (`linear_attn.norm` -> `ssm_norm`, applied as w): back with w - 1;
- Qwen3.5 (dense and MoE) only, where there are more value heads than key heads: the value heads reordered from grouped
  by key head to tiled (rows of in_proj_qkv's v part, in_proj_z, in_proj_a, in_proj_b, A_log, dt_bias, the conv's v
  channels; columns of out_proj): back with the inverse order;
- Qwen3-Next only: in_proj_qkvz ([q, k, v, z] per key head) split into `attn_qkv` ([all q, all k, all v]) and
  `attn_gate` (all z): back into in_proj_qkvz as `Part`s;
- MoE models: the experts stacked into `ffn_{gate,up,down}_exps`: gate and up go back into the fused
  `experts.gate_up_proj` as `Part`s;
- MTP layers (blocks past `block_count - nextn_predict_layers`) are not part of the HF model: dropped.
Nothing else is transformed (no rope permutation: these are NeoX-rope models).
"""

from __future__ import annotations

import re

import torch

from ..architectures import Part
from ._common import as_tensor, half_of, token_ids

ARCHITECTURES = {"qwen35": "qwen3_5_text", "qwen35moe": "qwen3_5_moe_text", "qwen3next": "qwen3_next"}
_CLASSES = {"qwen35": "Qwen3_5ForCausalLM", "qwen35moe": "Qwen3_5MoeForCausalLM", "qwen3next": "Qwen3NextForCausalLM"}
_TILED = ("qwen35", "qwen35moe")  # value heads reordered by the converter

_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output.weight": "lm_head.weight",
    "output_norm.weight": "model.norm.weight",
}
_LAYER = {  # GGUF name within a block (gguf.TENSOR_NAMES) -> HF name within model.layers.N
    "attn_norm.weight": "input_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ssm_a": "linear_attn.A_log",
    "ssm_dt.bias": "linear_attn.dt_bias",
    "ssm_conv1d.weight": "linear_attn.conv1d.weight",
    "ssm_norm.weight": "linear_attn.norm.weight",
    "ssm_out.weight": "linear_attn.out_proj.weight",
    "attn_qkv.weight": "linear_attn.in_proj_qkv.weight",
    "attn_gate.weight": "linear_attn.in_proj_z.weight",
    "ssm_alpha.weight": "linear_attn.in_proj_a.weight",
    "ssm_beta.weight": "linear_attn.in_proj_b.weight",
    "ssm_ba.weight": "linear_attn.in_proj_ba.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
    "ffn_gate_up_exps.weight": "mlp.experts.gate_up_proj",
    "ffn_down_exps.weight": "mlp.experts.down_proj",
    "ffn_gate_exps.weight": "mlp.experts.gate_up_proj",
    "ffn_up_exps.weight": "mlp.experts.gate_up_proj",
}
_NORMS_PLUS_ONE = (
    "attn_norm.weight",
    "post_attention_norm.weight",
    "attn_q_norm.weight",
    "attn_k_norm.weight",
    "output_norm.weight",
)
_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")


def config(meta: dict) -> dict:
    arch = meta["general.architecture"]

    def get(key: str, default=None):
        return meta.get(f"{arch}.{key}", default)

    n_layers = int(get("block_count")) - int(get("nextn_predict_layers", 0) or 0)
    head_dim = int(get("attention.key_length"))
    heads_v = int(get("ssm.time_step_rank"))
    recurrent = get("attention.recurrent_layers")
    if recurrent is None:
        interval = int(get("full_attention_interval", 4))
        recurrent = [(i + 1) % interval != 0 for i in range(n_layers)]
    rope = {
        "rope_type": "default",
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "partial_rotary_factor": int(get("rope.dimension_count", head_dim)) / head_dim,
    }
    sections = get("rope.dimension_sections")
    if arch in _TILED and sections and sum(sections[:3]) * 2 == get("rope.dimension_count"):
        rope.update(mrope_section=list(sections[:3]), mrope_interleaved=True)  # text alone: plain rope anyway
    cfg = {
        "model_type": ARCHITECTURES[arch],
        "architectures": [_CLASSES[arch]],
        "vocab_size": len(meta["tokenizer.ggml.tokens"]),
        "hidden_size": int(get("embedding_length")),
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": n_layers,
        "max_position_embeddings": int(get("context_length")),
        "num_attention_heads": int(get("attention.head_count")),
        "num_key_value_heads": int(get("attention.head_count_kv")),
        "head_dim": head_dim,
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
        "layer_types": ["linear_attention" if r else "full_attention" for r in recurrent[:n_layers]],
        "linear_conv_kernel_dim": int(get("ssm.conv_kernel")),
        "linear_key_head_dim": int(get("ssm.state_size")),
        "linear_num_key_heads": int(get("ssm.group_count")),
        "linear_num_value_heads": heads_v,
        "linear_value_head_dim": int(get("ssm.inner_size")) // heads_v,
        "rope_parameters": rope,
        "hidden_act": "silu",
    }
    cfg.update(token_ids(meta))
    if arch in ("qwen3next", "qwen35moe"):
        cfg.update(
            num_experts=int(get("expert_count")),
            num_experts_per_tok=int(get("expert_used_count")),
            moe_intermediate_size=int(get("expert_feed_forward_length")),
            shared_expert_intermediate_size=int(get("expert_shared_feed_forward_length")),
        )
    if arch == "qwen3next":
        cfg.update(decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True)
    return cfg


def tensors(name: str, array, meta: dict, cfg: dict) -> list[tuple[str, torch.Tensor | Part]]:
    arch = meta["general.architecture"]
    m = _BLOCK.fullmatch(name)
    if m and int(m.group(1)) >= cfg["num_hidden_layers"]:
        return []  # an MTP layer (nextn.eh_proj, nextn.enorm, ... and a whole decoder layer)
    if name in _GLOBAL:
        local, hf = name, _GLOBAL[name]
    elif m and m.group(2) in _LAYER:
        local, hf = m.group(2), f"model.layers.{m.group(1)}.{_LAYER[m.group(2)]}"
    else:
        raise KeyError(name)
    w = as_tensor(array)
    if local in _NORMS_PLUS_ONE:
        w = w - 1
    elif local == "ssm_a":
        w = torch.log(-w)
    elif local == "ssm_conv1d.weight":
        w = w.unsqueeze(1)
    if arch in _TILED:
        w = _untile_value_heads(local, w, cfg)
    elif local in ("attn_qkv.weight", "attn_gate.weight"):
        return [
            (
                hf.replace("in_proj_qkv", "in_proj_qkvz").replace("in_proj_z", "in_proj_qkvz"),
                Part(_qkvz_rows(local, cfg), 0, w),
            )
        ]
    if local in ("ffn_gate_exps.weight", "ffn_up_exps.weight"):  # gate rows first, then up, along dim 1
        return [(hf, half_of(0 if local == "ffn_gate_exps.weight" else 1, 1, w))]
    return [(hf, w)]


def _tiled(cfg: dict, head_dim: int) -> torch.Tensor | None:
    """The converter's value-head order (tiled: v0 of every key head, then v1, ...) as indices into HF's
    (grouped by key head); None where there are as many value heads as key heads (nothing was moved)."""
    nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    if nk == nv:
        return None
    idx = torch.arange(nv * head_dim).reshape(nk, nv // nk, head_dim)
    return idx.permute(1, 0, 2).reshape(-1)


def _untile_value_heads(local: str, w: torch.Tensor, cfg: dict) -> torch.Tensor:
    """Qwen3.5: the value heads back in HF's grouped order (`_LinearAttentionVReorderBase`)."""
    hv = cfg["linear_value_head_dim"]
    if local in ("attn_gate.weight", "ssm_out.weight", "attn_qkv.weight", "ssm_conv1d.weight"):
        order = _tiled(cfg, hv)
    elif local in ("ssm_alpha.weight", "ssm_beta.weight", "ssm_a", "ssm_dt.bias"):
        order = _tiled(cfg, 1)
    else:
        return w
    if order is None:
        return w
    undo = torch.empty_like(order)
    undo[order] = torch.arange(len(order))  # file position of each HF position
    if local == "ssm_out.weight":
        return w[:, undo]
    if local in ("attn_qkv.weight", "ssm_conv1d.weight"):  # the v rows follow q and k
        qk = 2 * cfg["linear_key_head_dim"] * cfg["linear_num_key_heads"]
        return torch.cat([w[:qk], w[qk:][undo]])
    return w[undo]


def _qkvz_rows(local: str, cfg: dict) -> torch.Tensor:
    """Qwen3-Next: the rows of HF's in_proj_qkvz ([q, k, v, z] per key head) that `attn_qkv` ([all q, all k,
    all v]) or `attn_gate` (all z) hold, in the file's order."""
    nk, hk = cfg["linear_num_key_heads"], cfg["linear_key_head_dim"]
    vz = cfg["linear_num_value_heads"] // nk * cfg["linear_value_head_dim"]  # v (or z) rows per key head
    group = 2 * hk + 2 * vz
    heads = torch.arange(nk)[:, None] * group
    if local == "attn_gate.weight":
        return (heads + 2 * hk + vz + torch.arange(vz)).reshape(-1)
    q = heads + torch.arange(hk)
    return torch.cat([q.reshape(-1), (q + hk).reshape(-1), (heads + 2 * hk + torch.arange(vz)).reshape(-1)])

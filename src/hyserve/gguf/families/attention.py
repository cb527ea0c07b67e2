"""Plain attention models' GGUF files (`llama`, `qwen2`, `qwen3`: SmolLM2, Llama 3, Qwen2.5, Qwen3, ...), as
llama.cpp's converter writes them (conversion/llama.py: LlamaModel; conversion/qwen.py: Qwen2Model, Qwen3Model),
back to the HF model.

What the converter did and `tensors` undoes: for `llama` only, the q and k rows (weights and biases) permuted for
llama.cpp's rotary layout (LlamaModel.permute, k over the key-value heads): permuted back, a permutation of whole
rows, so Q8_0 / Q4_0 blocks stay as they are. Qwen2 and Qwen3 rotate NeoX-style: nothing is permuted. A Llama 3
rope (`rope_type: llama3`) has no metadata: the converter writes its per-frequency factors as the `rope_freqs`
tensor, which `config` reads back into the published parameters (a file whose factors are not those is refused);
linear and YaRN scaling are metadata (`rope.scaling.*`).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ..file import GGUFError
from ._common import arch_value, as_tensor, attention_names, block, has, required, token_ids, unpermute, vocab_size

ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
_CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}

_TOP = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "rope_freqs.weight": None,  # Llama 3's rope factors: in the config (`rope_parameters`), not a weight
}
_LAYER = {  # GGUF name within a block -> HF name within `model.layers.N`
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    **attention_names("self_attn"),
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate.bias": "mlp.gate_proj.bias",
    "ffn_up.bias": "mlp.up_proj.bias",
    "ffn_down.bias": "mlp.down_proj.bias",
}
# Llama 3.1 / 3.2's rope_scaling but the factor (8 and 32): what every published Llama 3 file was made from
_LLAMA3 = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def config(meta: dict) -> dict:
    arch = meta["general.architecture"]
    if has(meta, "blk.0.ffn_gate_exps.weight", False):
        raise GGUFError(f"a {arch} file with experts (Mixtral-style MoE) is not supported")
    heads = int(required(meta, "attention.head_count"))
    hidden = int(required(meta, "embedding_length"))
    head_dim = int(arch_value(meta, "attention.key_length", 0) or arch_value(meta, "rope.dimension_count", 0))
    head_dim = head_dim or hidden // heads
    if (rotary := arch_value(meta, "rope.dimension_count")) is not None and int(rotary) != head_dim:
        raise GGUFError(f"a {arch} file that rotates {rotary} of each head's {head_dim} dimensions (not supported)")
    cfg = {
        "model_type": ARCHITECTURES[arch],
        "architectures": [_CLASSES[arch]],
        "vocab_size": vocab_size(meta),
        "hidden_size": hidden,
        "intermediate_size": int(required(meta, "feed_forward_length")),
        "num_hidden_layers": int(required(meta, "block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(arch_value(meta, "attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "max_position_embeddings": int(required(meta, "context_length")),
        "rms_norm_eps": float(required(meta, "attention.layer_norm_rms_epsilon")),
        "rope_parameters": rope_parameters(meta, head_dim),
        "hidden_act": "silu",
        **token_ids(meta),
    }
    if arch in ("llama", "qwen3"):
        cfg["attention_bias"] = has(meta, "blk.0.attn_q.bias", False)
    if arch == "llama":
        cfg["mlp_bias"] = has(meta, "blk.0.ffn_gate.bias", False)
    return cfg


def rope_parameters(meta: dict, head_dim: int) -> dict:
    """transformers' rope_parameters from the file: the base, linear or YaRN scaling from `rope.scaling.*`, Llama
    3's from its `rope_freqs` factors (which the loader puts in the metadata, see `loader.file_metadata`)."""
    theta = float(arch_value(meta, "rope.freq_base", 10000.0))
    kind = arch_value(meta, "rope.scaling.type", "none")
    factor = arch_value(meta, "rope.scaling.factor")
    if (freqs := meta.get("rope_freqs")) is not None:
        return _llama3(np.asarray(freqs, dtype=np.float64), theta, head_dim)
    if kind == "linear" and factor:
        return {"rope_type": "linear", "rope_theta": theta, "factor": float(factor)}
    if kind == "yarn" and factor:
        rope = {
            "rope_type": "yarn",
            "rope_theta": theta,
            "factor": float(factor),
            "original_max_position_embeddings": int(required(meta, "rope.scaling.original_context_length")),
        }
        for key, hf in (("attn_factor", "attention_factor"), ("yarn_beta_fast", "beta_fast"),
                        ("yarn_beta_slow", "beta_slow")):  # fmt: skip
            if (value := arch_value(meta, f"rope.scaling.{key}")) is not None:
                rope[hf] = float(value)
        return rope
    if kind not in ("none", "linear", "yarn"):
        raise GGUFError(f"a {meta['general.architecture']} file with {kind} rope scaling (not supported)")
    return {"rope_type": "default", "rope_theta": theta}


def _llama3(file_factors: np.ndarray, theta: float, head_dim: int) -> dict:
    """Llama 3's rope_parameters whose factors (convert_hf_to_gguf.py's LlamaModel.generate_extra_tensors) are the
    file's `rope_freqs`."""
    rope = {"rope_type": "llama3", "rope_theta": theta, "factor": float(file_factors.max()), **_LLAMA3}
    if not np.allclose(llama3_factors(rope, head_dim), file_factors, rtol=1e-5, atol=0):
        raise GGUFError(
            "the file's rope_freqs are not Llama 3's rope scaling with low_freq_factor 1, high_freq_factor 4 and "
            "original_max_position_embeddings 8192 (not supported)"
        )
    return rope


def llama3_factors(rope: dict, head_dim: int) -> np.ndarray:
    """The factors convert_hf_to_gguf.py writes as `rope_freqs` for these Llama 3 rope parameters (its formula)."""
    freqs = 1.0 / (rope["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def tensors(name: str, array, meta: dict, cfg: dict) -> list[tuple[str, torch.Tensor]]:
    data = as_tensor(array)
    bid, rest = block(name)
    if bid is None:
        hf = _TOP[name]
        return [] if hf is None else [(hf, data)]
    if meta["general.architecture"] == "llama" and rest in ("attn_q.weight", "attn_q.bias"):
        data = unpermute(data, cfg["num_attention_heads"])
    elif meta["general.architecture"] == "llama" and rest in ("attn_k.weight", "attn_k.bias"):
        data = unpermute(data, cfg["num_key_value_heads"])
    return [(f"model.layers.{bid}.{_LAYER[rest]}", data)]

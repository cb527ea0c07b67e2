"""Falcon-H1 GGUF files (`falcon-h1`), as llama.cpp's converter writes them (conversion/falcon_h1.py:
FalconH1Model on Mamba2Model), back to the HF model.

What the converter did and `tensors` undoes: the Mamba2 mixer's steps (`_mamba2`). Not undone, because the file
does not keep them: Falcon-H1's µP multipliers (embedding, lm_head, attention in/out, key, ssm in/out, the five
in_proj sections, the two MLP ones), which the converter multiplied into the weights. The config sets them all to
1, so the HF model computes what the folded weights mean (and what llama.cpp computes). q/k are not permuted
(Falcon-H1's rotary is NeoX-style), and each block holds attention, Mamba2 and an MLP side by side.
"""

from __future__ import annotations

import torch

from ..file import GGUFError
from . import _mamba2
from ._common import (
    arch_value,
    has,
    hidden_and_heads,
    required,
    rope_parameters,
    tensors_by_block,
    token_ids,
    top_names,
    vocab_size,
)

ARCHITECTURES = {"falcon-h1": "falcon_h1"}

_TOP = top_names("embed_tokens", "final_layernorm")
_LAYER = {  # GGUF name within a block -> HF name within `model.layers.N`
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "pre_ff_layernorm.weight",
    "ffn_norm": "pre_ff_layernorm.weight",  # what the converter writes: FFN_PRE_NORM maps without ".weight"
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "feed_forward.gate_proj.weight",
    "ffn_up.weight": "feed_forward.up_proj.weight",
    "ffn_down.weight": "feed_forward.down_proj.weight",
}
_UNFOLDABLE = (
    "attn_q.bias",
    "attn_k.bias",
    "attn_v.bias",
    "attn_output.bias",
    "ffn_gate.bias",
    "ffn_up.bias",
    "ffn_down.bias",
    "ssm_in.bias",
    "ssm_out.bias",
)


def config(meta: dict) -> dict:
    names = meta.get("tensor_shapes", {})
    if biased := sorted({n.split(".", 2)[2] for n in names if n.startswith("blk.")} & set(_UNFOLDABLE)):
        raise GGUFError(
            f"a Falcon-H1 file with biases ({', '.join(biased)}) is not supported: the "
            "converter folds the µP multipliers into weights, not into biases"
        )
    n_layers = int(required(meta, "block_count"))
    hidden, heads = hidden_and_heads(meta)
    ssm = _mamba2.dims(meta)
    return {
        "architectures": ["FalconH1ForCausalLM"],
        "model_type": "falcon_h1",
        "vocab_size": vocab_size(meta),
        "hidden_size": hidden,
        "num_hidden_layers": n_layers,
        "intermediate_size": int(required(meta, "feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(required(meta, "attention.head_count_kv")),
        "head_dim": int(arch_value(meta, "attention.key_length") or hidden // heads),
        "max_position_embeddings": int(required(meta, "context_length")),
        "rms_norm_eps": float(required(meta, "attention.layer_norm_rms_epsilon")),
        "rope_parameters": rope_parameters(meta),
        "mamba_d_ssm": ssm["inner"],
        **_mamba2.mamba_sizes(ssm),
        "mamba_expand": max(1, ssm["inner"] // hidden),
        "mamba_conv_bias": has(meta, "blk.0.ssm_conv1d.bias", True),
        "mamba_proj_bias": False,
        "mamba_rms_norm": has(meta, "blk.0.ssm_norm.weight", False),
        "mamba_norm_before_gate": False,  # llama.cpp's Mamba2 norms y * silu(z)
        "attention_bias": False,
        "mlp_bias": False,
        "projectors_bias": False,
        # folded into the weights by the converter
        "embedding_multiplier": 1.0,
        "lm_head_multiplier": 1.0,
        "attention_in_multiplier": 1.0,
        "attention_out_multiplier": 1.0,
        "key_multiplier": 1.0,
        "ssm_in_multiplier": 1.0,
        "ssm_out_multiplier": 1.0,
        "ssm_multipliers": [1.0] * 5,
        "mlp_multipliers": [1.0, 1.0],
        **token_ids(meta),
    }


def _in_block(prefix: str, rest: str, data: torch.Tensor, cfg: dict) -> list:
    if (mixer := _mamba2.mixer_tensor(rest, data)) is not None:
        return [(prefix + "mamba." + mixer[0], mixer[1])]
    return [(prefix + _LAYER[rest], data)]


tensors = tensors_by_block(_TOP, _in_block)

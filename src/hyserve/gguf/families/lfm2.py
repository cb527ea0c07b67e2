"""LFM2 GGUF files (`lfm2`: LFM2-350M ... LFM2-2.6B, LFM2.5), as llama.cpp's converter writes them
(conversion/lfm2.py: LFM2Model), back to the HF model.

The converter squeezed the short convolution's weight from (channels, 1, kernel) to (channels, kernel) and
renamed the rest (LFM2-MoE's module, `lfm2_moe`, undoes the same for the dense layers: its `tensors` serves both);
nothing is permuted. Attention layers are those with `head_count_kv` > 0. The MLP's width is its tensors' (the
converter wrote `feed_forward_length` after its own `block_auto_adjust_ff_dim`, which rounds where transformers'
may not), and the config does not adjust it again.
"""

from __future__ import annotations

from ..file import GGUFError
from ._common import arch_value, has, per_layer, required, token_ids, vocab_size
from .lfm2_moe import tensors  # noqa: F401 (the family interface: the dense layers' names are LFM2-MoE's)

ARCHITECTURES = {"lfm2": "lfm2"}


def config(meta: dict) -> dict:
    n_layers = int(required(meta, "block_count"))
    kv = [int(n) for n in per_layer(required(meta, "attention.head_count_kv"), n_layers)]
    types = ["full_attention" if k else "conv" for k in kv]
    if "conv" not in types:
        raise GGUFError("an lfm2 file without convolution layers")
    first_conv = types.index("conv")
    return {
        "architectures": ["Lfm2ForCausalLM"],
        "model_type": "lfm2",
        "vocab_size": vocab_size(meta),
        "hidden_size": int(required(meta, "embedding_length")),
        "intermediate_size": _mlp_width(meta, n_layers),
        "block_auto_adjust_ff_dim": False,
        "num_hidden_layers": n_layers,
        "layer_types": types,
        "num_attention_heads": int(required(meta, "attention.head_count")),
        "num_key_value_heads": max(kv) or int(required(meta, "attention.head_count")),
        "max_position_embeddings": int(required(meta, "context_length")),
        "norm_eps": float(required(meta, "attention.layer_norm_rms_epsilon")),
        "rope_parameters": {"rope_type": "default", "rope_theta": float(arch_value(meta, "rope.freq_base", 10000.0))},
        "conv_L_cache": int(required(meta, "shortconv.l_cache")),
        "conv_bias": has(meta, f"blk.{first_conv}.shortconv.in_proj.bias", False),
        **token_ids(meta),
    }


def _mlp_width(meta: dict, n_layers: int) -> int:
    shape = meta.get("tensor_shapes", {}).get("blk.0.ffn_up.weight")
    return int(shape[0]) if shape else int(per_layer(required(meta, "feed_forward_length"), n_layers)[0])

"""CPU kernels hyserve puts in place of three transformers reference functions: the same math, less work.

1. Attention with grouped KV heads (`hyserve_sdpa`). transformers' "sdpa" path repeats every KV head
   for its query heads (a full copy of the cache, per layer, per forward) whenever a mask is passed,
   which is every prefill chunk after a cached prefix. Here SDPA reads the shared heads itself
   (`enable_gqa`); the outputs are bit-identical on CPU (tests/test_kernels.py).
2. The Gated DeltaNet decode step (one token, `torch_recurrent_gated_delta_rule`). The reference forms
   four [batch, heads, dk, dv] temporaries per layer per token (state * k, k outer delta, ...); here
   the reads of the state are batched matrix-vector products and the update is one in-place
   rank-1 `baddbmm_` on a fresh copy. Equal to the reference to float32 rounding (about 1e-7).
3. Linear layers for a decode batch. For 13-48 rows, MKL's x @ W^T with row-major float32 weights is
   slower than the same product taken as (W @ x^T)^T (16 rows of 512 -> 1536, measured here: 217
   against 99 us with the weight in cache, 302 against 249 us streamed from memory as in a model);
   a batched decode step runs one row per request through every layer.
   The results were bit-identical in every shape tested (tests/test_kernels.py checks closeness).

All three apply only on hyserve's model thread (`model_thread`): a test's transformers reference run on
the same model object stays plain transformers, so comparing the two still checks these kernels.
`benchmarks/kernels.py` measures them against the reference, side by side.
`HYSERVE_KERNELS=0` leaves transformers' functions alone.
"""

from __future__ import annotations

import importlib
import os
import types

import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from . import model_thread

ATTENTION = "hyserve_sdpa"
# modules whose forward calls a module-level `torch_recurrent_gated_delta_rule`
_DELTANET_MODULES = ("transformers.models.qwen3_5.modeling_qwen3_5", "transformers.models.qwen3_next.modeling_qwen3_next")


def enabled() -> bool:
    return os.environ.get("HYSERVE_KERNELS", "1") != "0"


def install(model) -> None:
    """Use hyserve's kernels for `model` (call after loading). A no-op when disabled."""
    if not enabled():
        return
    _register_attention()
    if getattr(model.config, "_attn_implementation", None) == "sdpa":
        model.set_attn_implementation(ATTENTION)
    for name in _DELTANET_MODULES:
        _patch_recurrent(name)
    for module in model.modules():
        if type(module) is torch.nn.Linear:
            module.forward = types.MethodType(linear_forward, module)


# -- linear layers -----------------------------------------------------------------------------------
SKINNY_ROWS = range(13, 49)  # rows for which (W @ x^T)^T beats F.linear here (benchmarks/kernels.py)


def linear_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """`nn.Linear.forward`, except that a skinny float32 CPU input on the model thread takes the faster
    product order."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if (rows in SKINNY_ROWS and x.dtype == torch.float32 and x.device.type == "cpu"
            and model_thread.on_model_thread()):
        y = torch.mm(self.weight, x.reshape(rows, x.shape[-1]).t()).t()
        if self.bias is not None:
            y = y + self.bias
        return y.contiguous().view(*x.shape[:-1], self.out_features)
    return F.linear(x, self.weight, self.bias)


# -- attention -------------------------------------------------------------------------------------
def _register_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION, gqa_sdpa_attention)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)  # the same masks as "sdpa"


def gqa_sdpa_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                       **kwargs):
    """transformers' SDPA attention, except that a masked multi-token query reads grouped KV heads in place."""
    groups = getattr(module, "num_key_value_groups", 1)
    plain = (not model_thread.on_model_thread() or groups == 1 or attention_mask is None or query.shape[2] == 1
             or query.device.type != "cpu" or kwargs.get("position_bias") is not None
             or kwargs.get("softcap") is not None or kwargs.get("output_attentions"))
    # decode (transformers packs the heads itself), unmasked prefill, not hyserve's thread, or a GPU (where a
    # mask with enable_gqa falls back to the math kernel, as transformers notes)
    if plain:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                         scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


# -- Gated DeltaNet decode step --------------------------------------------------------------------
def _patch_recurrent(module_name: str) -> None:
    try:
        mod = importlib.import_module(module_name)
    except ImportError:
        return
    reference = getattr(mod, "torch_recurrent_gated_delta_rule", None)
    if reference is None or getattr(reference, "_hyserve_reference", None) is not None:
        return  # absent in this transformers version, or already patched

    def dispatch(query, key, value, g, beta, initial_state=None, output_final_state=False,
                 use_qk_l2norm_in_kernel=False, **kwargs):
        if (model_thread.on_model_thread() and query.shape[1] == 1 and initial_state is not None
                and kwargs.get("cu_seqlens") is None):
            return recurrent_step(query, key, value, g, beta, initial_state, output_final_state,
                                  use_qk_l2norm_in_kernel)
        return reference(query, key, value, g, beta, initial_state=initial_state,
                         output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                         **kwargs)

    dispatch._hyserve_reference = reference
    mod.torch_recurrent_gated_delta_rule = dispatch


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)  # as transformers (and FLA) define it


def recurrent_step(query, key, value, g, beta, initial_state, output_final_state=True,
                   use_qk_l2norm_in_kernel=False):
    """One token of the gated delta rule for a batch: S' = exp(g) S + k (beta (v - k^T exp(g) S))^T,
    out = q^T S'. Shapes as transformers: q, k [b, 1, hk, dk]; v [b, 1, h, dv]; g, beta [b, 1, h];
    state [b, h, dk, dv]. Returns (out [b, 1, h, dv] in q's dtype, new float32 state or None)."""
    dtype = query.dtype
    b, _, hk, dk = key.shape
    h, dv = value.shape[-2:]
    q, k, v = (x[:, 0].float() for x in (query, key, value))  # [b, heads, d]
    if hk != h:
        q, k = q.repeat_interleave(h // hk, dim=1), k.repeat_interleave(h // hk, dim=1)
    if use_qk_l2norm_in_kernel:
        q, k = _l2norm(q), _l2norm(k)
    q = q / (dk**0.5)
    state = initial_state.float() * g[:, 0].float().exp()[..., None, None]  # a fresh tensor: the input stays as it was
    s = state.view(b * h, dk, dv)
    k = k.reshape(b * h, dk, 1)
    kv_mem = torch.bmm(k.transpose(1, 2), s)  # [b*h, 1, dv]
    delta = (v.reshape(b * h, 1, dv) - kv_mem) * beta[:, 0].float().reshape(b * h, 1, 1)
    s.baddbmm_(k, delta)
    out = torch.bmm(q.reshape(b * h, 1, dk), s).view(b, 1, h, dv).to(dtype)
    return out, (state if output_final_state else None)

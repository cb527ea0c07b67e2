"""Attention with grouped KV heads, registered with transformers' `AttentionInterface` as "hyserve_sdpa".

transformers' "sdpa" path repeats every KV head for its query heads (a full copy of the cache, per layer,
per forward) whenever a mask is passed, which is every prefill chunk after a cached prefix. Here SDPA
reads the shared heads itself (`enable_gqa`; bit-identical on CPU, tests/test_kernels.py). A short piece
against a long cache (a warm turn's new message over thousands of keys) instead stacks each KV head's
queries into one product and a softmax (`grouped_attention`): SDPA's CPU flash kernel tiles the queries
into blocks of 32 and re-reads the keys per query head. A decode step (one query per row) hands each KV
head's queries to SDPA as query rows of that head (`decode_attention`).
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from . import native, seam, verify
from .seam import active

NAME = "hyserve_sdpa"
NATIVE = "_hyserve_native_attention"  # an attention layer's C decode attention (`install_native`)


def register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, gqa_sdpa_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)  # the same masks as "sdpa"


def gqa_sdpa_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """transformers' SDPA attention, except that a masked multi-token query reads grouped KV heads in place."""
    groups = getattr(module, "num_key_value_groups", 1)
    if _decode_rows(query, key, attention_mask, groups, dropout, kwargs):
        native = module.__dict__.get(NATIVE)
        out = native(query, key, value, attention_mask, scaling) if native is not None else None
        return (decode_attention(query, key, value, attention_mask, scaling) if out is None else out), None
    plain = (
        not active()
        or groups == 1
        or attention_mask is None
        or query.shape[2] == 1
        or query.device.type != "cpu"
        or kwargs.get("position_bias") is not None
        or kwargs.get("softcap") is not None
        or kwargs.get("output_attentions")
    )
    # decode (transformers packs the heads itself), unmasked prefill, not hyserve's thread, or a GPU (where a
    # mask with enable_gqa falls back to the math kernel, as transformers notes)
    if plain:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    if dropout == 0.0 and _short_over_long(query, key, attention_mask):
        out = grouped_attention(query, key, value, attention_mask, scaling)
    else:
        out = F.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=True
        )
    return out.transpose(1, 2).contiguous(), None


def _decode_rows(query, key, mask, groups: int, dropout: float, kwargs) -> bool:
    """A decode step (one query per row) on the CPU, on hyserve's thread, with grouped KV heads and a mask that
    is the same for every head (or none)."""
    return (
        active()
        and groups > 1
        and query.shape[2] == 1
        and query.device.type == "cpu"
        and dropout == 0.0
        and key.shape[1] * groups == query.shape[1]
        and (mask is None or (mask.dim() == 4 and mask.shape[1] == 1 and mask.shape[2] == 1))
        and kwargs.get("position_bias") is None
        and kwargs.get("softcap") is None
        and not kwargs.get("output_attentions")
        and kwargs.get("sinks") is None
        and kwargs.get("s_aux") is None
    )


def decode_attention(query, key, value, mask, scaling=None):
    """One query per row, q [b, h, 1, d], against grouped KV heads k, v [b, hk, S, d]: each KV head's `h / hk`
    queries go into SDPA as that many query rows of one head, with no causal mask among them (they share one
    position). transformers' SDPA path instead hands SDPA the grouped heads (`enable_gqa`), whose CPU flash kernel
    is many times slower on a decode batch (`benchmarks/bench_kernels.py --micro` times both),
    or repeats every KV head. The same as repeating the heads: bit for bit in bfloat16, within a unit of the last place
    in float32 (tests/test_kernels.py). Returns
    [b, 1, h, dv], as transformers' attention functions."""
    b, h, _, d = query.shape
    hk = key.shape[1]
    grouped = query.reshape(b, hk, h // hk, d)
    out = F.scaled_dot_product_attention(grouped, key, value, attn_mask=mask, scale=scaling, is_causal=False)
    return out.reshape(b, 1, h, value.shape[-1])


def install_native(model, lib) -> str | None:
    """Give each grouped-query attention layer of a bfloat16 `model` the C decode attention
    (`native.DecodeAttention`), when it gives `decode_attention`'s results on probes of the layers' shapes
    (KV with spare columns, left-padded rows). Returns "" when it did, why not when it did not, None when
    there is nothing it is written for."""
    layers = [
        m
        for m in model.modules()
        if getattr(m, "num_key_value_groups", 1) > 1 and hasattr(m, "head_dim") and hasattr(m, "q_proj")
    ]
    if not layers or layers[0].q_proj.weight.dtype != torch.bfloat16:
        return None
    kernel = native.DecodeAttention(lib)
    kv_heads = getattr(getattr(layers[0], "config", None), "num_key_value_heads", None)
    if not isinstance(kv_heads, int):
        return None  # a layout it cannot probe: SDPA stays
    heads, dim = kv_heads * layers[0].num_key_value_groups, layers[0].head_dim
    scaling = getattr(layers[0], "scaling", None)
    g = torch.Generator().manual_seed(0)
    for rows, keys in ((1, 37), (1, 700), (3, 300)):
        q = torch.randn(rows, heads, 1, dim, generator=g).to(torch.bfloat16)
        k, v = (
            (torch.randn(rows, kv_heads, keys + 64, dim, generator=g) * 2).to(torch.bfloat16)[:, :, :keys]
            for _ in range(2)
        )
        mask = torch.ones(rows, 1, 1, keys, dtype=torch.bool)
        for r in range(rows):  # a decode batch's rows are left-padded to the longest
            mask[r, ..., : 7 * r] = False
        with torch.inference_mode():
            got = kernel(q, k, v, mask, scaling)
            if got is None:
                return "it refused the layers' own shapes"
            if why := verify.mismatch(got, decode_attention(q, k, v, mask, scaling), torch.bfloat16):
                return why
    registry = seam.patches(model)
    for layer in layers:
        registry.set("native_attention", layer, NATIVE, kernel)
    return ""


def uninstall_native(model) -> None:
    seam.revert(model, "native_attention")


# A few queries against a long cache (a warm turn's new message): plain products beat SDPA's CPU flash
# kernel when all the scores fit in cache at once (`benchmarks/bench_kernels.py --micro`).
SHORT_MAX_QUERIES = 128
SHORT_MIN_KEYS = 1024
SHORT_MAX_SCORE_BYTES = 24 << 20


def _short_over_long(query, key, mask) -> bool:
    b, h, length, _ = query.shape
    keys = key.shape[2]
    return (
        b == 1
        and mask is not None
        and mask.dtype == torch.bool
        and mask.dim() == 4
        and mask.shape[1] == 1
        and length <= SHORT_MAX_QUERIES
        and keys >= SHORT_MIN_KEYS
        and h * length * keys * 4 <= SHORT_MAX_SCORE_BYTES
        and query.dtype == torch.float32
    )


def grouped_attention(query, key, value, mask, scaling=None):
    """softmax(q k^T * scale, masked) v for q [1, h, L, d], k and v [1, hk, S, d] with h/hk query heads per KV
    head (transformers' order), and a boolean mask [1, 1, L, S] (True: attend) that leaves every query at
    least one key. The queries of a KV head are stacked into one product against its keys. Returns
    [1, h, L, dv], as SDPA."""
    b, h, length, d = query.shape
    hk, keys = key.shape[1], key.shape[2]
    groups = h // hk
    scale = d**-0.5 if scaling is None else scaling  # applied to the queries: 79 rows, not 79 x 4.2k scores
    shape = (b, hk, groups * length, keys)
    scores = torch.matmul(
        (query * scale).reshape(b, hk, groups * length, d), key.transpose(-1, -2), out=_scratch("scores", shape, query)
    )
    first, blocked = _blocked_tail(mask)
    if blocked is not None:
        scores.view(b, hk, groups, length, keys)[..., first:].masked_fill_(blocked[:, :, None], float("-inf"))
    probs = torch.ops.aten._softmax.out(scores, -1, False, out=scores)  # in place: one pass less over memory
    return torch.matmul(probs, value).view(b, h, length, value.shape[-1])


_SCRATCH = threading.local()


def _blocked_tail(mask: torch.Tensor) -> tuple[int, torch.Tensor | None]:
    """The first key column some query may not see (a cached prefix is open to all: a warm turn's new
    tokens) and the blocked part of `mask` from there (None: nothing blocked). The scan reads the whole
    mask (79 x 4.2k on a warm turn); every attention layer of a forward pass gets the same mask object, so
    the result for the last one is kept (with a reference to it, so that its memory is not reused by another)."""
    last = getattr(_SCRATCH, "mask", None)
    if last is not None and last[0] is mask:
        return last[1], last[2]
    hidden = torch.nonzero((~mask).any(dim=-2).view(-1))
    first = int(hidden[0]) if len(hidden) else mask.shape[-1]
    blocked = ~mask[..., first:] if len(hidden) else None
    _SCRATCH.mask = (mask, first, blocked)
    return first, blocked


def _scratch(name: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    """A buffer of `shape` for `grouped_attention`'s scores (its softmax runs in place), kept between calls by each
    thread (in a server only the model thread calls it; at most SHORT_MAX_SCORE_BYTES). Allocating two fresh 10 MB
    buffers per call made glibc map and unmap them each time whenever its heap had just been trimmed, and
    the first touch of every page then cost several times the product itself."""
    numel = 1
    for n in shape:
        numel *= n
    buffers = _SCRATCH.__dict__
    buf = buffers.get(name)
    # (a buffer made under inference mode, as serving makes them, cannot be written outside it: a later model's
    # load-time check runs outside)
    if (
        buf is None
        or buf.numel() < numel
        or buf.dtype != like.dtype
        or buf.device != like.device
        or (buf.is_inference() and not torch.is_inference_mode_enabled())
    ):
        buf = buffers[name] = torch.empty(numel, dtype=like.dtype, device=like.device)
    return buf[:numel].view(shape)

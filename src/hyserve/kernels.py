"""CPU kernels hyserve puts in place of transformers reference functions: the same math, less work.

1. Attention with grouped KV heads (`hyserve_sdpa`). transformers' "sdpa" path repeats every KV head
   for its query heads (a full copy of the cache, per layer, per forward) whenever a mask is passed,
   which is every prefill chunk after a cached prefix. Here SDPA reads the shared heads itself
   (`enable_gqa`); the outputs are bit-identical on CPU (tests/test_kernels.py). A short piece against a
   long cache (a warm turn: 79 queries over 4.2k keys) instead stacks each KV head's queries into one
   product and a softmax (`grouped_attention`): SDPA's CPU flash kernel tiles 79 queries into blocks
   of 32 and re-reads the keys per query head (`benchmarks/kernels.py --micro` times both).
2. The Gated DeltaNet decode step (one token, `torch_recurrent_gated_delta_rule`). The reference forms
   four [batch, heads, dk, dv] temporaries per layer per token (state * k, k outer delta, ...), and
   the cache then copies its result into the state it already holds; here the state is updated in
   place (transformers' cache overwrites it in place anyway) by batched matrix-vector products and one
   rank-1 `baddbmm_`. Equal to the reference to float32 rounding (about 1e-7).
3. The Gated DeltaNet prefill (`torch_chunk_gated_delta_rule`) with a chunk size fitted to the piece
   (`chunk_size_for`): transformers pads every piece to a multiple of 64 tokens, so a warm turn's
   79 new tokens paid for 128. The chunked form is exact for any chunk size; results differ from
   64-token chunks by float32 rounding (about 1e-7 in the output, 1e-6 in the state). The function is
   `chunked_delta_rule`: the reference's math with its decays exponentiated by `safe_exp` (PyTorch's
   exp takes a slow path where the result underflows, as most pairwise decays of a chunk do), one
   triangular solve instead of two, and fused multiply-adds in the chunk scan.
4. The depthwise causal conv1d of the same layers and of Mamba2 (`causal_conv1d_fn` for prefill,
   `causal_conv1d_update` for decode). The reference is a grouped `F.conv1d`, which oneDNN runs slowly
   for one filter per channel; here prefill is `kernel` shifted multiply-adds (bit-identical in the
   shapes tested) and a decode step one batched product per channel.
5. Linear layers for a decode batch. For 13-48 rows, MKL's x @ W^T with row-major float32 weights is
   slower than the same product taken as (W @ x^T)^T (16 rows of 512 -> 1536, measured here: 217
   against 99 us with the weight in cache, 302 against 249 us streamed from memory as in a model);
   a batched decode step runs one row per request through every layer. The result is returned as
   that transposed view (rows stay contiguous among themselves, so every reshape the models do still
   works): making it contiguous cost a quarter of the product.
   The results were bit-identical in every shape tested (tests/test_kernels.py checks closeness).

All of them apply only on hyserve's model thread (`model_thread`): a test's transformers reference run on
the same model object stays plain transformers, so comparing the two still checks these kernels.
`benchmarks/kernels.py` measures them against the reference, side by side.
`HYSERVE_KERNELS=0` leaves transformers' functions alone.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import threading
import types

import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from . import model_thread

ATTENTION = "hyserve_sdpa"
# modules whose forward calls a module-level `torch_recurrent_gated_delta_rule`
_DELTANET_MODULES = ("transformers.models.qwen3_5.modeling_qwen3_5", "transformers.models.qwen3_next.modeling_qwen3_next")
# modules whose forward calls module-level `causal_conv1d_fn` / `causal_conv1d_update`
_CONV_MODULES = (*_DELTANET_MODULES, "transformers.models.mamba2.modeling_mamba2")
_SILU = ("silu", "swish")


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
        _patch(name, "torch_recurrent_gated_delta_rule", _recurrent_applies, _recurrent_fast)
        _patch(name, "torch_chunk_gated_delta_rule", _chunked_applies, _chunked_fitted)
    for name in _CONV_MODULES:
        _patch(name, "causal_conv1d_update", _conv_applies, lambda _reference, *a, **k: conv_step(*a, **k))
        _patch(name, "causal_conv1d_fn", _conv_fn_applies, lambda _reference, *a, **k: conv_prefill(*a, **k))
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
        return y.view(*x.shape[:-1], self.out_features)  # a transposed view: see the module docstring
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
    if dropout == 0.0 and _short_over_long(query, key, attention_mask):
        out = grouped_attention(query, key, value, attention_mask, scaling)
    else:
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                             scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


# A few queries against a long cache (a warm turn's new message): plain products beat SDPA's CPU flash
# kernel when all the scores fit in cache at once (`benchmarks/kernels.py --micro`).
SHORT_MAX_QUERIES = 128
SHORT_MIN_KEYS = 1024
SHORT_MAX_SCORE_BYTES = 24 << 20


def _short_over_long(query, key, mask) -> bool:
    b, h, length, _ = query.shape
    keys = key.shape[2]
    return (b == 1 and mask is not None and mask.dtype == torch.bool and mask.dim() == 4 and mask.shape[1] == 1
            and length <= SHORT_MAX_QUERIES and keys >= SHORT_MIN_KEYS and h * length * keys * 4 <= SHORT_MAX_SCORE_BYTES
            and query.dtype == torch.float32)


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
    scores = torch.matmul((query * scale).reshape(b, hk, groups * length, d), key.transpose(-1, -2),
                          out=_scratch("scores", shape, query))
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
    buffers per call made glibc map and unmap them each time whenever its heap had just been trimmed: the
    first touch of every page then cost 8.9 instead of 3.2 ms per call (a `benchmarks/kernels.py --micro` run
    before and after, in the fourth session of 2026-12-03)."""
    numel = 1
    for n in shape:
        numel *= n
    buffers = _SCRATCH.__dict__
    buf = buffers.get(name)
    if buf is None or buf.numel() < numel or buf.dtype != like.dtype or buf.device != like.device:
        buf = buffers[name] = torch.empty(numel, dtype=like.dtype, device=like.device)
    return buf[:numel].view(shape)


# -- transformers' module-level functions (Gated DeltaNet, Mamba2) ----------------------------------
def _patch(module_name: str, attr: str, applies, fast) -> None:
    """Replace `module_name.attr` by a function that calls `fast(original, ...)` when `applies(...)` on the
    model thread, and the original (kept as `_hyserve_reference`) otherwise."""
    try:
        mod = importlib.import_module(module_name)
    except ImportError:
        return
    reference = getattr(mod, attr, None)
    if reference is None or getattr(reference, "_hyserve_reference", None) is not None:
        return  # absent in this transformers version, or already patched

    def dispatch(*args, **kwargs):
        if model_thread.on_model_thread() and applies(*args, **kwargs):
            return fast(reference, *args, **kwargs)
        return reference(*args, **kwargs)

    dispatch._hyserve_reference = reference
    setattr(mod, attr, dispatch)


# -- Gated DeltaNet decode step ---------------------------------------------------------------------
def _recurrent_applies(query, key, value, g, beta, initial_state=None, output_final_state=False,
                       use_qk_l2norm_in_kernel=False, **kwargs) -> bool:
    return query.shape[1] == 1 and initial_state is not None and kwargs.get("cu_seqlens") is None


def _recurrent_fast(_reference, query, key, value, g, beta, initial_state=None, output_final_state=False,
                    use_qk_l2norm_in_kernel=False, **kwargs):
    return recurrent_step(query, key, value, g, beta, initial_state, output_final_state, use_qk_l2norm_in_kernel)


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)  # as transformers (and FLA) define it


def recurrent_step(query, key, value, g, beta, initial_state, output_final_state=True,
                   use_qk_l2norm_in_kernel=False):
    """One token of the gated delta rule for a batch: S' = exp(g) S + k (beta (v - k^T exp(g) S))^T,
    out = q^T S'. Shapes as transformers: q, k [b, 1, hk, dk]; v [b, 1, h, dv]; g, beta [b, 1, h];
    state [b, h, dk, dv]. A contiguous float32 `initial_state` is updated in place and returned as the
    new state; any other is left alone. Returns (out [b, 1, h, dv] in q's dtype, new state or None)."""
    dtype = query.dtype
    b, _, hk, dk = key.shape
    h, dv = value.shape[-2:]
    q, k, v = (x[:, 0].float() for x in (query, key, value))  # [b, heads, d]
    if hk != h:
        q, k = q.repeat_interleave(h // hk, dim=1), k.repeat_interleave(h // hk, dim=1)
    if use_qk_l2norm_in_kernel:
        q, k = _l2norm(q), _l2norm(k)
    q = q / (dk**0.5)
    decay = g[:, 0].float().exp()[..., None, None]
    if initial_state.dtype == torch.float32 and initial_state.is_contiguous():
        state = initial_state.mul_(decay)
    else:
        state = initial_state.float() * decay
    s = state.view(b * h, dk, dv)
    k = k.reshape(b * h, dk, 1)
    kv_mem = torch.bmm(k.transpose(1, 2), s)  # [b*h, 1, dv]
    delta = (v.reshape(b * h, 1, dv) - kv_mem) * beta[:, 0].float().reshape(b * h, 1, 1)
    s.baddbmm_(k, delta)
    out = torch.bmm(q.reshape(b * h, 1, dk), s).view(b, 1, h, dv).to(dtype)
    return out, (state if output_final_state else None)


# -- Gated DeltaNet prefill: chunk size fitted to the piece ---------------------------------------
def chunk_size_for(length: int) -> int:
    """The chunk size for a prefill piece of `length` tokens. transformers pads every piece to a multiple
    of 64, so a warm turn's 79 new tokens cost two chunks (128 rows) of every per-chunk product. A piece
    of up to 96 tokens runs as one chunk of exactly its length (no padded rows); a longer one in chunks
    of 32 when that pads less than 64 would. `benchmarks/kernels.py` measures the warm turn with and without."""
    if length <= 96:
        return max(1, length)
    return 32 if -(-length // 32) * 32 < -(-length // 64) * 64 else 64


def _chunked_applies(query, key, value, g, beta, chunk_size=None, *args, **kwargs) -> bool:
    return chunk_size is None and kwargs.get("cu_seqlens") is None and not args


def _chunked_fitted(_reference, query, key, value, g, beta, initial_state=None, output_final_state=False,
                    use_qk_l2norm_in_kernel=False, **kwargs):
    cap = _capture_for(query)
    if cap is None:
        return chunked_delta_rule(query, key, value, g, beta, chunk_size_for(query.shape[1]), initial_state,
                                  output_final_state, use_qk_l2norm_in_kernel)
    # one run per stretch between capture offsets, each from the state the one before it ended in
    outs, states, state = [], [], initial_state
    edges = (0, *cap.offsets, cap.length)
    for start, end in zip(edges, edges[1:]):
        out, state = chunked_delta_rule(query[:, start:end], key[:, start:end], value[:, start:end],
                                        g[:, start:end], beta[:, start:end], chunk_size_for(end - start), state,
                                        True, use_qk_l2norm_in_kernel)
        outs.append(out)
        states.append(state)
    cap.recurrent.append(states[:-1])
    return torch.cat(outs, dim=1), (state if output_final_state else None)


# exp(x) of float32 is 0 or a denormal below this (log of the smallest normal float32, 1.18e-38)
_EXP_FLOOR = -87.0


def safe_exp(x: torch.Tensor) -> torch.Tensor:
    """exp(x), but 0 where x < -87 (where float32 exp is a denormal, 1e-38 or less, or 0). PyTorch's
    vectorized exp takes a slow path for such inputs, many times slower per element even with denormals
    flushed (`benchmarks/kernels.py --micro`: exp of a chunk's worth of underflowing decays)."""
    return x.clamp(min=_EXP_FLOOR).exp_().masked_fill_(x < _EXP_FLOOR, 0.0)


_UPPER: dict[tuple[int, torch.device], torch.Tensor] = {}


def _strictly_upper(n: int, device: torch.device) -> torch.Tensor:
    mask = _UPPER.get((n, device))
    if mask is None:
        mask = _UPPER[(n, device)] = torch.ones(n, n, dtype=torch.bool, device=device).triu(1)
    return mask


def chunked_delta_rule(query, key, value, g, beta, chunk_size: int, initial_state=None, output_final_state=False,
                       use_qk_l2norm_in_kernel=False):
    """The gated delta rule over a prefill piece, chunk by chunk: transformers'
    `torch_chunk_gated_delta_rule` with the same math and chunking, fewer passes over memory. Decays are
    exponentiated with `safe_exp`, both triangular solves are one, and each chunk's three state products
    are fused multiply-adds. Shapes as transformers: q, k [b, L, hk, dk]; v [b, L, h, dv]; g, beta [b, L, h];
    state [b, h, dk, dv]. Returns (out [b, L, h, dv] in q's dtype, final state or None)."""
    dtype = query.dtype
    b, length, hk, dk = key.shape
    h, dv = value.shape[-2:]
    q, k = query.float(), key.float()
    if use_qk_l2norm_in_kernel:  # per row: the same before as after repeating the key heads, at half the work
        q, k = _l2norm(q), _l2norm(k)
    q = q * dk**-0.5
    if hk != h:
        q, k = q.repeat_interleave(h // hk, dim=2), k.repeat_interleave(h // hk, dim=2)
    q, k, v = (x.transpose(1, 2) for x in (q, k, value.float()))  # [b, h, L, d]
    beta, g = beta.transpose(1, 2).float(), g.transpose(1, 2).float()  # [b, h, L]
    pad = -length % chunk_size
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        beta, g = F.pad(beta, (0, pad)), F.pad(g, (0, pad))
    n, c = (length + pad) // chunk_size, chunk_size
    q, k, v = (x.reshape(b * h, n, c, x.shape[-1]) for x in (q, k, v))
    beta = beta.reshape(b * h, n, c, 1)
    cum = g.reshape(b * h, n, c).cumsum(-1)
    # pairwise decays exp(cum_i - cum_j) for j <= i; above the diagonal the difference is positive: zero it
    pair = cum.unsqueeze(-1) - cum.unsqueeze(-2)
    decay = safe_exp(pair.masked_fill_(_strictly_upper(c, pair.device), float("-inf")))
    k_beta = k * beta
    kt = k.transpose(-1, -2)
    ut = torch.matmul(k_beta, kt).mul_(decay)
    attn = torch.matmul(q, kt).mul_(decay)
    e_cum = safe_exp(cum).unsqueeze(-1)  # [bh, n, c, 1]
    # both right-hand sides in one column-major block: the solver takes it without a copy
    rhs = torch.empty(b * h, n, dv + dk, c, dtype=torch.float32, device=q.device).transpose(-1, -2)
    torch.mul(v, beta, out=rhs[..., :dv])
    torch.mul(k_beta, e_cum, out=rhs[..., dv:])
    solved = torch.linalg.solve_triangular(ut, rhs, upper=False, unitriangular=True)
    new_values, k_cumdecay = solved[..., :dv], solved[..., dv:]
    q_decayed = q * e_cum
    last = cum[..., -1:]  # [bh, n, 1]
    k_decayed = (k * safe_exp(last - cum).unsqueeze(-1)).transpose(-1, -2)  # [bh, n, dk, c]
    chunk_decay = safe_exp(last).unsqueeze(-1)  # [bh, n, 1, 1]
    if initial_state is None:
        state = torch.zeros(b * h, dk, dv, dtype=torch.float32, device=q.device)
    else:
        state = initial_state.reshape(b * h, dk, dv).float()
    out = torch.empty(b * h, n, c, dv, dtype=torch.float32, device=q.device)
    for i in range(n):
        v_new = torch.baddbmm(new_values[:, i], k_cumdecay[:, i], state, alpha=-1)
        torch.baddbmm(torch.bmm(q_decayed[:, i], state), attn[:, i], v_new, out=out[:, i])
        state = torch.baddbmm(state * chunk_decay[:, i], k_decayed[:, i], v_new)
    out = out.view(b, h, n * c, dv)[:, :, :length].transpose(1, 2).to(dtype, memory_format=torch.contiguous_format)
    return out, (state.view(b, h, dk, dv) if output_final_state else None)


# -- depthwise causal conv1d -------------------------------------------------------------------------
def _conv_applies(hidden_states, conv_state, weight, bias=None, activation=None) -> bool:
    return (hidden_states.shape[-1] == 1 and weight.dim() == 2 and conv_state.shape[-1] >= weight.shape[-1]
            and activation in (None, *_SILU) and hidden_states.dtype == conv_state.dtype == weight.dtype)


def conv_step(hidden_states, conv_state, weight, bias=None, activation=None):
    """One token of a depthwise causal conv1d: shift `hidden_states` [b, channels, 1] into `conv_state`
    [b, channels, state_len] (in place, as the reference does) and return the activated output
    [b, channels, 1] of the last `kernel` columns against `weight` [channels, kernel]."""
    channels, kernel = weight.shape
    window = torch.cat([conv_state[:, :, 1:], hidden_states], dim=-1)
    conv_state.copy_(window)
    window = window[:, :, -kernel:]
    per_channel = window.permute(1, 0, 2)  # [channels, b, kernel]
    if bias is None:
        out = torch.bmm(per_channel, weight.view(channels, kernel, 1))
    else:
        out = torch.baddbmm(bias.view(channels, 1, 1), per_channel, weight.view(channels, kernel, 1))
    out = out.permute(1, 0, 2)  # [b, channels, 1]
    return F.silu(out) if activation in _SILU else out


def _conv_fn_applies(hidden_states, weight, bias=None, activation=None, **kwargs) -> bool:
    return (weight.dim() == 2 and activation in (None, *_SILU) and hidden_states.dtype == weight.dtype
            and hidden_states.shape[1] == weight.shape[0])


def conv_prefill(hidden_states, weight, bias=None, activation=None, **kwargs):
    """Depthwise causal conv1d over a whole piece: `hidden_states` [b, channels, L], `weight`
    [channels, kernel], zero left padding, activated output [b, channels, L]."""
    kernel, length = weight.shape[1], hidden_states.shape[-1]
    cap = _capture_for(hidden_states, seq_dim=-1)
    if cap is not None:
        cap.conv.append([_conv_window(hidden_states, length - cap.length + o, kernel) for o in cap.offsets])
    x = F.pad(hidden_states, (kernel - 1, 0))
    out = x[:, :, :length] * weight[:, :1]
    for k in range(1, kernel):
        out.addcmul_(x[:, :, k : k + length], weight[:, k : k + 1])
    if bias is not None:
        out += bias[:, None]
    return F.silu(out) if activation in _SILU else out


def _conv_window(x: torch.Tensor, end: int, kernel: int) -> torch.Tensor:
    """The conv state after column `end` of `x` [b, channels, n]: its last `kernel` columns, zero-padded on
    the left as transformers pads a first piece shorter than the kernel. A copy."""
    window = x[:, :, max(0, end - kernel) : end]
    return F.pad(window, (kernel - window.shape[-1], 0)) if window.shape[-1] < kernel else window.clone()


# -- states inside a prefill piece ---------------------------------------------------------------------
class PieceCapture:
    """The recurrent state of every Gated DeltaNet layer after `offsets` tokens of one prefill piece of
    `length` tokens (batch 1), collected while the piece runs, so a checkpoint inside the piece costs no
    pass of its own. The conv kernel sees the layer's previous conv state followed by the piece
    (transformers' `update_conv_state`), so the window before each offset is the conv state there; the
    delta rule runs once per stretch between offsets, from the state the stretch before ended in, which is
    the state there. `conv` and `recurrent` get one list (a tensor per offset) per layer, in layer order."""

    def __init__(self, length: int, offsets):
        self.length = length
        self.offsets = tuple(offsets)
        if not all(a < b for a, b in zip((0, *self.offsets), (*self.offsets, length))):
            raise ValueError(f"capture offsets must ascend strictly inside the piece: {offsets} of {length}")
        self.conv: list[list[torch.Tensor]] = []
        self.recurrent: list[list[torch.Tensor]] = []
        self.unexpected = 0  # kernel calls during the capture that did not fit the piece


_CAPTURE = threading.local()


@contextlib.contextmanager
def capture(length: int, offsets):
    """Collect a `PieceCapture` while a forward pass of one `length`-token piece runs on this thread."""
    cap = PieceCapture(length, offsets)
    _CAPTURE.current = cap
    try:
        yield cap
    finally:
        _CAPTURE.current = None


def _capture_for(x: torch.Tensor, seq_dim: int = 1) -> PieceCapture | None:
    """The capture in progress on this thread, if `x` (batch 1) can be one of its piece's layers: the delta
    rule's input holds exactly the piece's tokens (`seq_dim` 1), the conv's (`seq_dim` -1) the piece after
    the previous conv state or padding, so at least as many."""
    cap = getattr(_CAPTURE, "current", None)
    if cap is None:
        return None
    n = x.shape[seq_dim]
    if x.shape[0] != 1 or n < cap.length or (seq_dim == 1 and n != cap.length):
        cap.unexpected += 1  # the pass is not what the capture was set up for: it yields no states
        return None
    return cap

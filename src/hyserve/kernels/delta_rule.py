"""The Gated DeltaNet delta rule (Qwen3.5, Qwen3-Next): a decode step and a chunked prefill.

- Decode (`recurrent_step`, for transformers' `fused_recurrent_gated_delta_rule`): the reference forms four
  [batch, heads, dk, dv] temporaries per layer per token, and the cache then copies its result into the
  state it already holds; here the state is updated in place by batched matrix-vector products and one
  rank-1 `baddbmm_`.
- Prefill (`chunked_delta_rule`, for `chunk_gated_delta_rule`) with a chunk size fitted to the piece
  (`chunk_size_for`): transformers pads every piece to a multiple of 64 tokens, so a warm turn's few
  dozen new tokens paid for 64 or 128. The chunked form is exact for any chunk size (results differ by
  float32 rounding). Decays are exponentiated by `safe_exp` (PyTorch's exp takes a slow path where the
  result underflows, as most pairwise decays of a chunk do), both triangular solves are one, and the
  chunk scan uses fused multiply-adds.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .capture import capture_for
from .seam import Kernel


def _recurrent_applies(
    query,
    key,
    value,
    g=None,
    beta=None,
    initial_state=None,
    output_final_state=False,
    use_qk_l2norm_in_kernel=False,
    **kwargs,
) -> bool:
    return query.shape[1] == 1 and initial_state is not None and kwargs.get("cu_seqlens") is None


def _recurrent_fast(
    _reference,
    query,
    key,
    value,
    g,
    beta,
    initial_state=None,
    output_final_state=False,
    use_qk_l2norm_in_kernel=False,
    **kwargs,
):
    return recurrent_step(query, key, value, g, beta, initial_state, output_final_state, use_qk_l2norm_in_kernel)


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)  # as transformers (and FLA) define it


def recurrent_step(query, key, value, g, beta, initial_state, output_final_state=True, use_qk_l2norm_in_kernel=False):
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


# -- prefill: chunk size fitted to the piece --------------------------------------------------------
def chunk_size_for(length: int) -> int:
    """The chunk size for a prefill piece of `length` tokens. transformers pads every piece to a multiple
    of 64, so a warm turn's 79 new tokens cost two chunks (128 rows) of every per-chunk product. A piece
    of up to 96 tokens runs as one chunk of exactly its length (no padded rows); a longer one in chunks
    of 32 when that pads less than 64 would. `benchmarks/bench_kernels.py` measures the warm turn with and without."""
    if length <= 96:
        return max(1, length)
    return 32 if -(-length // 32) * 32 < -(-length // 64) * 64 else 64


def _chunked_applies(query, key, value, g=None, beta=None, chunk_size=None, *args, **kwargs) -> bool:
    return chunk_size is None and kwargs.get("cu_seqlens") is None and not args


def _chunked_fitted(
    _reference,
    query,
    key,
    value,
    g,
    beta,
    initial_state=None,
    output_final_state=False,
    use_qk_l2norm_in_kernel=False,
    **kwargs,
):
    cap = capture_for(query)
    if cap is None:
        return chunked_delta_rule(
            query,
            key,
            value,
            g,
            beta,
            chunk_size_for(query.shape[1]),
            initial_state,
            output_final_state,
            use_qk_l2norm_in_kernel,
        )
    # one run per stretch between capture offsets, each from the state the one before it ended in
    outs, states, state = [], [], initial_state
    edges = (0, *cap.offsets, cap.length)
    for start, end in zip(edges, edges[1:]):
        out, state = chunked_delta_rule(
            query[:, start:end],
            key[:, start:end],
            value[:, start:end],
            g[:, start:end],
            beta[:, start:end],
            chunk_size_for(end - start),
            state,
            True,
            use_qk_l2norm_in_kernel,
        )
        outs.append(out)
        states.append(state)
    cap.recurrent.append(states[:-1])
    return torch.cat(outs, dim=1), (state if output_final_state else None)


# exp(x) of float32 is 0 or a denormal below this (log of the smallest normal float32, 1.18e-38)
_EXP_FLOOR = -87.0


def safe_exp(x: torch.Tensor) -> torch.Tensor:
    """exp(x), but 0 where x < -87 (where float32 exp is a denormal, 1e-38 or less, or 0). PyTorch's
    vectorized exp takes a slow path for such inputs, many times slower per element even with denormals
    flushed (`benchmarks/bench_kernels.py --micro`: exp of a chunk's worth of underflowing decays)."""
    return x.clamp(min=_EXP_FLOOR).exp_().masked_fill_(x < _EXP_FLOOR, 0.0)


_UPPER: dict[tuple[int, torch.device], torch.Tensor] = {}


def _strictly_upper(n: int, device: torch.device) -> torch.Tensor:
    mask = _UPPER.get((n, device))
    if mask is None:
        mask = _UPPER[(n, device)] = torch.ones(n, n, dtype=torch.bool, device=device).triu(1)
    return mask


def chunked_delta_rule(
    query,
    key,
    value,
    g,
    beta,
    chunk_size: int,
    initial_state=None,
    output_final_state=False,
    use_qk_l2norm_in_kernel=False,
):
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


# -- the hooks and their load-time probes ---------------------------------------------------------
def _probe(layer, batch: int, length: int, with_state: bool, seed: int):
    """Inputs of a Gated DeltaNet `layer`'s own shapes and dtypes, called as its forward calls the rule;
    every fifth token decays strongly enough to underflow."""
    g = torch.Generator().manual_seed(seed)
    dtype, device = layer.out_proj.weight.dtype, layer.out_proj.weight.device
    hk, h, dk, dv = layer.num_k_heads, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device)

    gate = -torch.rand(batch, length, h, generator=g) * 4
    gate[:, ::5] -= 100
    kwargs = dict(
        g=gate.to(device),
        beta=torch.rand(batch, length, h, generator=g).to(device, dtype),
        initial_state=rand(batch, h, dk, dv, scale=0.3) if with_state else None,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
        cu_seqlens=None,
    )
    return (
        (
            rand(batch, length, hk, dk).to(dtype),
            rand(batch, length, hk, dk).to(dtype),
            rand(batch, length, h, dv).to(dtype),
        ),
        kwargs,
        (),
    )


def _is_layer(module) -> bool:
    return all(hasattr(module, a) for a in ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim", "out_proj"))


RECURRENT = Kernel(
    "fused_recurrent_gated_delta_rule",
    "torch_recurrent_gated_delta_rule",
    _is_layer,
    _recurrent_applies,
    _recurrent_fast,
    lambda layer: [_probe(layer, 2, 1, True, 1)],
)
CHUNKED = Kernel(
    "chunk_gated_delta_rule",
    "torch_chunk_gated_delta_rule",
    _is_layer,
    _chunked_applies,
    _chunked_fitted,
    lambda layer: [_probe(layer, 1, n, state, n) for n, state in ((37, True), (5, False), (130, True))],
)

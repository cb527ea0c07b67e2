"""The depthwise causal conv1d of Gated DeltaNet and Mamba2 layers: `conv_prefill` for a piece
(transformers' `causal_conv1d_fn`), `conv_step` for one token (`causal_conv1d_update`). The reference is a
grouped `F.conv1d`, which oneDNN runs slowly for one filter per channel; here prefill is `kernel` shifted
multiply-adds and a decode step one batched product per channel, taken in float32 (as oneDNN accumulates
the reference) and rounded once: PyTorch's bfloat16 `bmm` over thousands of 4-tap products is much slower
than the float32 one (`benchmarks/bench_kernels.py --micro`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .capture import capture_for
from .seam import Kernel

_SILU = ("silu", "swish")


def _conv_applies(hidden_states, conv_state, weight, bias=None, activation=None) -> bool:
    return (
        hidden_states.shape[-1] == 1
        and weight.dim() == 2
        and conv_state.shape[-1] >= weight.shape[-1]
        and activation in (None, *_SILU)
        and hidden_states.dtype == conv_state.dtype == weight.dtype
    )


def conv_step(hidden_states, conv_state, weight, bias=None, activation=None):
    """One token of a depthwise causal conv1d: shift `hidden_states` [b, channels, 1] into `conv_state`
    [b, channels, state_len] (in place, as the reference does) and return the activated output
    [b, channels, 1] of the last `kernel` columns against `weight` [channels, kernel]."""
    channels, kernel = weight.shape
    window = torch.cat([conv_state[:, :, 1:], hidden_states], dim=-1)
    conv_state.copy_(window)
    window = window[:, :, -kernel:]
    per_channel = window.permute(1, 0, 2).float()  # [channels, b, kernel]
    taps = weight.view(channels, kernel, 1).float()
    if bias is None:
        out = torch.bmm(per_channel, taps)
    else:
        out = torch.baddbmm(bias.view(channels, 1, 1).float(), per_channel, taps)
    out = out.permute(1, 0, 2).to(hidden_states.dtype)  # [b, channels, 1]
    return F.silu(out) if activation in _SILU else out


def _conv_fn_applies(hidden_states, weight, bias=None, activation=None, **kwargs) -> bool:
    return (
        weight.dim() == 2
        and activation in (None, *_SILU)
        and hidden_states.dtype == weight.dtype
        and hidden_states.shape[1] == weight.shape[0]
    )


def conv_prefill(hidden_states, weight, bias=None, activation=None, **kwargs):
    """Depthwise causal conv1d over a whole piece: `hidden_states` [b, channels, L], `weight`
    [channels, kernel], zero left padding, activated output [b, channels, L]."""
    kernel, length = weight.shape[1], hidden_states.shape[-1]
    cap = capture_for(hidden_states, seq_dim=-1)
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


# -- the hooks and their load-time probes ---------------------------------------------------------
def _inputs(layer, batch: int, length: int, seed: int):
    conv = layer.conv1d
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, conv.weight.shape[0], length, generator=g).to(conv.weight)
    return x, conv.weight.squeeze(1), conv.bias, getattr(layer, "activation", None)


def _step_probes(layer):
    x, weight, bias, act = _inputs(layer, 2, 1, 0)
    state = torch.randn(2, weight.shape[0], weight.shape[1], generator=torch.Generator().manual_seed(1)).to(weight)
    return [((x, state, weight, bias), {"activation": act}, (1,))]  # the conv state is updated in place


def _prefill_probes(layer):
    return [
        ((x, weight, bias), {"activation": act}, ())
        for x, weight, bias, act in (_inputs(layer, 1, n, n) for n in (2, 37))
    ]


def _is_layer(module) -> bool:
    return isinstance(getattr(module, "conv1d", None), torch.nn.Conv1d) and hasattr(module, "activation")


STEP = Kernel(
    "causal_conv1d_update",
    "causal_conv1d_update",
    _is_layer,
    _conv_applies,
    lambda _reference, *a, **k: conv_step(*a, **k),
    _step_probes,
)
PREFILL = Kernel(
    "causal_conv1d_fn",
    "causal_conv1d_fn",
    _is_layer,
    _conv_fn_applies,
    lambda _reference, *a, **k: conv_prefill(*a, **k),
    _prefill_probes,
)

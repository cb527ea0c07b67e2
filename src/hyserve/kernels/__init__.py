"""CPU kernels hyserve puts in place of transformers' reference functions: the same math, less work.

- `attention`: grouped-KV SDPA and a grouped product for short pieces over long caches, registered
  through transformers' `AttentionInterface`.
- `delta_rule`: the Gated DeltaNet decode step and chunked prefill.
- `conv`: the depthwise causal conv1d of Gated DeltaNet and Mamba2 layers.
- `linear`: skinny linear layers (a decode batch's few dozen rows).
- `norm`: RMSNorm layers in fewer operations (Qwen3.5's zero-centered one in C for a few bfloat16 rows).
- `decode_layer`: Qwen3.5's decoder layers for one decode token, without the module dispatch around them.
- `native`: C kernels built at load for bfloat16 models (`decode_step.c`): a few rows' products with a weight,
  a zero-centered RMSNorm, the Gated DeltaNet decode step between its products, and a decode step's attention
  over grouped KV heads.
- `capture`: states from inside a prefill piece, handed out by the delta-rule and conv kernels.

`seam` is where they are hooked into a model (transformers' per-layer kernel slots, as `kernelize` uses
them), and the one registry of everything they replace (`seam.patches(model)`, `seam.revert_all`); `verify` is the
load-time check each must pass against the installed transformers before it is switched on. `install` returns what was
decided (`KernelReport`); the runtime exposes it on `/health` and as a metric. `HYSERVE_KERNELS=0` leaves transformers'
functions alone.
"""

from __future__ import annotations

import logging
import os
import types
import weakref

import torch

from . import attention, conv, decode_layer, delta_rule, linear, native, norm, seam, verify
from .attention import gqa_sdpa_attention, grouped_attention
from .capture import PieceCapture, capture
from .conv import conv_prefill, conv_step
from .delta_rule import chunk_size_for, chunked_delta_rule, recurrent_step, safe_exp
from .linear import linear_forward
from .seam import KernelReport, active, hook, reference_only, slots

log = logging.getLogger("hyserve.kernels")

FUNCTIONS = (delta_rule.RECURRENT, delta_rule.CHUNKED, conv.STEP, conv.PREFILL)
ALL = (
    "attention",
    "native_attention",
    "linear",
    "native_linear",
    "norm",
    "native_norm",
    *(k.name for k in FUNCTIONS),
    "decode_layer",
    "native_gdn_step",
    "capture",
)

__all__ = [
    "ALL",
    "KernelReport",
    "PieceCapture",
    "active",
    "capture",
    "chunk_size_for",
    "chunked_delta_rule",
    "conv_prefill",
    "conv_step",
    "enabled",
    "gqa_sdpa_attention",
    "grouped_attention",
    "install",
    "linear_forward",
    "recurrent_step",
    "reference_only",
    "safe_exp",
]


def enabled() -> bool:
    return os.environ.get("HYSERVE_KERNELS", "1") != "0"


def install(model, adapter, vocab: int) -> KernelReport:
    """Switch on, for `model`, each kernel that matches transformers' own function on this model's shapes,
    then check the model end to end with and without them (and the captured-state path, for adapters that
    capture). Call on the model thread after loading. Everything that fails stays (or is put back) off,
    with one warning."""
    report = KernelReport()
    adapter.kernels = report
    if not enabled():
        for name in ALL:
            report.set(name, False, "disabled (HYSERVE_KERNELS=0)")
        return report
    device = next(model.parameters()).device
    if device.type != "cpu":  # written and measured for CPU; on a GPU transformers' own (FLA, causal-conv1d) run
        for name in ALL:
            report.set(name, False, f"disabled (CPU kernels; the model is on {device.type})")
        return report
    dtype = next(model.parameters()).dtype
    _install_attention(model, report, dtype)
    _install_linear(model, report)
    if report.on("linear") and dtype == torch.bfloat16:
        _install_native(report, "native_linear", lambda lib: linear.install_native(model, native.Products(lib)))
    if norm.install(model, dtype):
        report.set("norm", True)
        if dtype == torch.bfloat16:
            _install_native(report, "native_norm", lambda lib: norm.install_native(model, lib))
    for kernel in FUNCTIONS:
        _install_function(model, kernel, report)
    fast = {k.name: k.fast for k in FUNCTIONS if report.on(k.name)}  # the decode layer runs these
    if decode_layer.install(model, fast.get(conv.STEP.name), fast.get(delta_rule.RECURRENT.name)):
        report.set("decode_layer", True)
        if (why := decode_layer.install_native(model)) is not None:
            report.set("native_gdn_step", not why, why)
    if report.on("attention") and dtype == torch.bfloat16:
        _install_native(report, "native_attention", lambda lib: attention.install_native(model, lib))
    hooked = [k for k in ALL if report.on(k)]
    if hooked and (why := verify.check_model(adapter, vocab, dtype)):
        seam.revert_all(model)
        for name in hooked:
            report.set(name, False, f"the model with kernels differs from transformers: {why}")
    if adapter.captures_with_kernels:
        if not (report.on(delta_rule.CHUNKED.name) and report.on(conv.PREFILL.name)):
            report.set("capture", False, "needs the chunked delta rule and conv prefill kernels")
        else:
            report.set("capture", True)
            if why := verify.check_capture(adapter, vocab, dtype):
                report.set("capture", False, f"a captured state differs from a split prefill's: {why}")
    if report.refused:
        log.warning(
            "hyserve kernels switched off, transformers' own functions run instead (slower, same results): %s",
            "; ".join(f"{k}: {v[5:]}" for k, v in report.refused.items()),
        )
    return report


def _install_native(report: KernelReport, name: str, install) -> None:
    """`install(lib)` with `decode_step.c`'s library, reported as `name`: "" on, why not (the library's own reason
    when it cannot be built), or None, nothing it is written for (then not reported)."""
    lib, why = native.library()
    why = why if lib is None else install(lib)
    if why is not None:
        report.set(name, not why, why)


def _install_attention(model, report: KernelReport, dtype) -> None:
    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return
    why = _check_attention(dtype)
    if why is None:
        attention.register()
        model.set_attn_implementation(attention.NAME)
        owner = weakref.ref(model)  # (the registry lives on the model)
        seam.patches(model).change(
            "attention",
            model.config,
            "_attn_implementation",
            lambda: owner() is not None and owner().set_attn_implementation("sdpa"),
        )
    report.set("attention", why is None, why or "")


def _check_attention(dtype) -> str | None:
    """Both of `gqa_sdpa_attention`'s paths against transformers' SDPA attention, on a grouped-query layout."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    class Layer(torch.nn.Module):
        num_key_value_groups, is_causal = 4, True

    g = torch.Generator().manual_seed(0)
    for rows, queries, keys in ((1, 7, 40), (1, 9, attention.SHORT_MIN_KEYS + 5), (3, 1, 40)):
        q = torch.randn(rows, 8, queries, 32, generator=g).to(dtype)
        k, v = (torch.randn(rows, 2, keys, 32, generator=g).to(dtype) for _ in range(2))
        mask = torch.ones(queries, keys, dtype=torch.bool).tril(keys - queries)[None, None].repeat(rows, 1, 1, 1)
        for r in range(rows):  # a decode batch's rows are left-padded to the longest
            mask[r, ..., : 5 * r] = False
        got = gqa_sdpa_attention(Layer(), q, k, v, mask, scaling=0.2)
        with reference_only():
            want = sdpa_attention_forward(Layer(), q, k, v, mask, scaling=0.2)
        if why := verify.mismatch(got[0], want[0], dtype):
            return why
    return None


def _install_linear(model, report: KernelReport) -> None:
    layers = [m for m in model.modules() if type(m) is torch.nn.Linear]
    if not layers:
        return
    registry = seam.patches(model)
    packed = [m for m in layers if linear.pack(m, registry)]
    why = None
    for module in [layers[0], *packed[-1:]]:  # the first layer, and the last packed one (the head)
        x = linear.probe(module)
        with torch.inference_mode():  # as served; the packed product is bit-identical to F.linear's
            got = linear_forward(module, x)
        want = torch.nn.functional.linear(x, module.weight, module.bias)
        why = why or (
            verify.mismatch(got, want, x.dtype)
            if module not in packed
            else None
            if torch.equal(got, want)
            else "a packed product differs from F.linear"
        )
    if why is None:
        for module in layers:
            registry.set("linear", module, "forward", types.MethodType(linear_forward, module))
        why = _group_siblings(model)
    else:
        registry.revert("linear")
    report.set("linear", why is None, why or "")


def _group_siblings(model) -> str | None:
    """Stack sibling projections (`linear.group`) when the first group's stacked product equals its members'
    own products bit for bit, for a decode row and for a prefill piece; else leave them apart."""
    groups = linear.group(model)
    if not groups:
        return None
    members = [m for m in model.modules() if m.__dict__.get(linear.GROUP) is groups[0]]
    for rows in (1, 8, 100):
        x = linear.probe(members[0])[:1].repeat(rows, 1).view(rows, 1, -1)
        x = x + torch.arange(rows, dtype=x.dtype).view(rows, 1, 1) / 64  # distinct rows
        with torch.inference_mode():
            want = [m.__dict__[linear.PACKED](x) for m in members]
            got = [linear_forward(m, x) for m in members]
        if not all(torch.equal(a, b) for a, b in zip(got, want)):
            linear.ungroup(model)
            log.info("sibling projections left apart: their stacked product differs from their own")
            return None
    linear.settle(model)
    return None


def _install_function(model, kernel, report: KernelReport) -> None:
    found = slots(model, kernel.name)
    if found and not (found := [(layer, f) for layer, f in found if kernel.is_layer(layer)]):
        # The slot is there, in layers of a kind the kernel was not written for (LFM2's short convolutions):
        # left as transformers has it.
        report.set(kernel.name, False, "no layer of the kind it was written for")
        return
    if found:
        layer, func = found[0]
        why = verify.check_function(kernel, seam.reference_of(func), layer)
        if why is None:
            registry = seam.patches(model)
            for _, f in found:
                hook(f, kernel, registry)
    elif sites := seam.global_sites(model, kernel):
        layer, home = sites[0]
        current = getattr(home, kernel.legacy)
        why = verify.check_function(kernel, getattr(current, "reference", current), layer)
        for h in {id(h): h for _, h in sites}.values():
            if why is None:
                seam.hook_global(h, kernel)
            else:  # process-wide: off for every model of this family
                seam.unhook_global(h, kernel)
    else:
        return  # the model has no such layer: nothing to hook
    report.set(kernel.name, why is None, why or "")

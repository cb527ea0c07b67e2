"""RMSNorm layers in fewer operations: PyTorch's one `rms_norm` where transformers writes the norm as six
(`to`, `pow`, `mean`, `add`, `rsqrt`, `mul`), and the weight's float32 form computed once instead of every call.

A decode step of a Qwen3.5 model runs some 80 norms of a few rows each: about a third of the step's operator
calls, each costing its dispatch whatever its size. The families write the same norm in a few ways (the
weight applied after the cast back, as Llama; `1 + weight` applied before it, zero-centered, as Qwen3.5 and
Gemma; a gated one after Gated DeltaNet's delta rule); each `FORMS` entry is one of them. A norm class gets
the first form that equals its own `forward` bit for bit on probes of its width (`matching_form`), checked
once per class at load; a class no form matches keeps its own forward. `HYSERVE_RMS_NORM=0` keeps them all.
In bfloat16 models the zero-centered form of a few rows runs as one C call (`install_native`), once it gives the
form's results on probes of each width.
"""

from __future__ import annotations

import os
import types

import torch
import torch.nn.functional as F

from . import seam, verify
from .native import ZeroCenteredNorm
from .seam import active

SCALE = "_hyserve_norm_scale"  # a zero-centered norm's `1 + weight` in float32
EPS = "_hyserve_norm_eps"  # the norm's epsilon, whichever attribute its class keeps it in
NATIVE = "_hyserve_norm_native"  # a zero-centered norm's C form (`native.ZeroCenteredNorm`), once checked


def _eps(module) -> float | None:
    eps = getattr(module, "eps", getattr(module, "variance_epsilon", None))
    return float(eps) if isinstance(eps, (int, float)) else None


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.rms_norm(x, (x.shape[-1],), None, eps)


def weight_after_cast(self, hidden_states):
    """Llama's: weight * normed.to(input dtype)."""
    return self.weight * _rms(hidden_states.float(), self.__dict__[EPS]).to(hidden_states.dtype)


def zero_centered(self, hidden_states):
    """Qwen3.5's and Gemma's: (normed * (1 + weight)).to(input dtype), in float32; a few bfloat16 rows in C once
    checked (`install_native`)."""
    native = self.__dict__.get(NATIVE)
    if native is not None and (y := native(hidden_states)) is not None:
        return y
    return (_rms(hidden_states.float(), self.__dict__[EPS]) * self.__dict__[SCALE]).type_as(hidden_states)


def gated(self, hidden_states, gate):
    """Gated DeltaNet's: (weight * normed.to(input dtype) * silu(gate in float32)).to(input dtype)."""
    dtype = hidden_states.dtype
    normed = self.weight * _rms(hidden_states.float(), self.__dict__[EPS]).to(dtype)
    return (normed * F.silu(gate.float())).to(dtype)


FORMS = (weight_after_cast, zero_centered, gated)


def _prepare(module, form, registry: seam.Patches | None = None) -> None:
    registry = registry if registry is not None else seam.Patches()
    registry.set("norm", module, EPS, _eps(module))
    if form is zero_centered:
        registry.set("norm", module, SCALE, 1.0 + module.weight.detach().float())


def _probes(module, dtype, form):
    g = torch.Generator().manual_seed(0)
    width = module.weight.shape[-1]
    for rows in (1, 8, 100):
        x = (torch.randn(rows, 1, width, generator=g) * 3).to(dtype)
        yield (x, (torch.randn(rows, 1, width, generator=g) * 3).to(dtype)) if form is gated else (x,)


def matching_form(module, dtype):
    """The first of `FORMS` that gives `module`'s own forward bit for bit on probes, or None."""
    if _eps(module) is None or not isinstance(getattr(module, "weight", None), torch.Tensor):
        return None
    own = type(module).forward
    for form in FORMS:
        trial = seam.Patches()  # the form's constants, for the probes only
        _prepare(module, form, trial)
        try:
            with torch.inference_mode():
                if all(torch.equal(form(module, *args), own(module, *args)) for args in _probes(module, dtype, form)):
                    return form
        except (RuntimeError, TypeError, ValueError):
            continue
        finally:
            trial.revert()
    return None


def install(model, dtype) -> int:
    """Give every norm of `model` whose class a form matches that form (on the model thread; elsewhere its own
    forward runs). Returns how many modules took one."""
    chosen: dict[type, object] = {}
    done = 0
    if os.environ.get("HYSERVE_RMS_NORM", "1") == "0":
        return done
    registry = seam.patches(model)
    for module in model.modules():
        cls = type(module)
        if "RMSNorm" not in cls.__name__ or not hasattr(cls, "forward"):
            continue
        if cls not in chosen:
            chosen[cls] = matching_form(module, dtype)
        form = chosen[cls]
        if form is None:
            continue
        _prepare(module, form, registry)
        registry.set("norm", module, "forward", types.MethodType(_dispatch(form, cls.forward), module))
        done += 1
    return done


def _dispatch(form, own):
    arity = 2 if form is gated else 1  # a call with other arguments (Mamba2's norm given a gate) is its own

    def forward(self, *args, **kwargs):
        if kwargs or len(args) != arity or not active():
            return own(self, *args, **kwargs)
        return form(self, *args)

    forward.form = form
    return forward


def install_native(model, lib) -> str | None:
    """Give every zero-centered bfloat16 norm of `model` (`zero_centered`) its C form (`native.ZeroCenteredNorm`)
    once it gives the PyTorch form's results on probes of each width (1, 3 and `ROWS` rows): "" when on, why not
    when not, None when there is no such norm (nothing to report)."""
    norms = [
        m
        for m in model.modules()
        if getattr(m.__dict__.get("forward"), "form", None) is zero_centered and m.weight.dtype == torch.bfloat16
    ]
    if not norms:
        return None
    forms = {m: ZeroCenteredNorm(lib, m.__dict__[SCALE], m.__dict__[EPS]) for m in norms}
    g = torch.Generator().manual_seed(0)
    checked = set()
    for m in norms:
        width = m.weight.shape[-1]
        if (width, m.__dict__[EPS]) in checked:
            continue
        checked.add((width, m.__dict__[EPS]))
        for rows in (1, 3, ZeroCenteredNorm.ROWS):
            x = (torch.randn(rows, 1, width, generator=g) * 3).to(torch.bfloat16)
            x[-1, 0, : width // 2] *= 1e-3  # a row of small and large values
            with torch.inference_mode():
                got, want = forms[m](x), zero_centered(m, x)
            if got is None:
                return "it refused the norm's own shapes"
            if why := verify.mismatch(got, want, torch.bfloat16):
                return why
    registry = seam.patches(model)
    for m, form in forms.items():
        registry.set("native_norm", m, NATIVE, form)
    return ""


def uninstall_native(model) -> None:
    seam.revert(model, "native_norm")


def uninstall(model) -> None:
    uninstall_native(model)
    seam.revert(model, "norm")

"""Where hyserve's kernels meet transformers: the one place that swaps a function for a faster one.

transformers attaches the functions a layer may have replaced (the Gated DeltaNet delta rule, the
causal conv1d of Gated DeltaNet and Mamba2) to each layer instance (`use_kernelized_func`, from the
`kernels` package): the layer's forward calls the module-level name, which routes to the instance's
own `_kernel_funcs[name]`. `kernelize` replaces that object's `forward`; hyserve does the same, per
model instance. Where transformers offers no slot (5.24 without a `kernels` release it accepts), the
layer's module-level name itself is replaced (`hook_global`), process-wide, with the same dispatch.

A hook runs hyserve's function only on hyserve's model thread (`model_thread`) and outside
`reference_only()`; anywhere else it runs the reference. A test's or the load-time check's reference
run on the same model object therefore stays plain transformers.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import types
from dataclasses import dataclass, field
from typing import Callable

from .. import model_thread

_LOCAL = threading.local()


def active() -> bool:
    """Whether hyserve's kernels run here: on the model thread and not inside `reference_only()`."""
    return model_thread.on_model_thread() and not getattr(_LOCAL, "reference", False)


@contextlib.contextmanager
def reference_only():
    """Run transformers' own functions on this thread for the duration (the load-time check's baseline)."""
    before = getattr(_LOCAL, "reference", False)
    _LOCAL.reference = True
    try:
        yield
    finally:
        _LOCAL.reference = before


@dataclass(frozen=True)
class Kernel:
    """A stand-in for transformers' hookable function `name` (module-level `legacy` where there is no
    slot, in layers that `is_layer`): `fast(reference, *args, **kwargs)` runs where
    `applies(*args, **kwargs)`; `probes(layer)` yields (args, kwargs, indices of arguments updated in
    place) of that layer's own shapes for the load-time check (`verify`)."""

    name: str
    legacy: str
    is_layer: Callable[..., bool]
    applies: Callable[..., bool]
    fast: Callable
    probes: Callable


@dataclass
class KernelReport:
    """What the load-time check decided for one model: each kernel on, or off with the reason."""

    status: dict[str, str] = field(default_factory=dict)

    def on(self, name: str) -> bool:
        return self.status.get(name) == "on"

    def set(self, name: str, ok: bool, reason: str = "") -> None:
        self.status[name] = "on" if ok else f"off: {reason}"

    @property
    def refused(self) -> dict[str, str]:
        return {k: v for k, v in self.status.items() if v != "on" and not v.startswith("off: disabled")}


def slots(model, name: str) -> list:
    """(layer, function object) for each layer of `model` that calls `name` through a slot (empty: none)."""
    found = []
    for module in model.modules():
        funcs = module.__dict__.get("_kernel_funcs")
        if funcs and name in funcs:
            found.append((module, funcs[name]))
    return found


def global_sites(model, kernel: Kernel) -> list:
    """(layer, its modeling module) for each layer of `model` that calls `kernel.legacy` as a module-level
    function instead (no slots in this transformers)."""
    found = []
    for module in model.modules():
        home = sys.modules.get(type(module).__module__)
        if home is not None and callable(getattr(home, kernel.legacy, None)) and kernel.is_layer(module):
            found.append((module, home))
    return found


def reference_of(func) -> Callable:
    """The function a slot ran before hyserve hooked it."""
    return getattr(func.forward, "reference", func.forward)


def hook(func, kernel: Kernel) -> None:
    """Make the slot `func` run `kernel` where it applies (on the model thread), its old forward elsewhere."""
    reference = reference_of(func)

    def forward(_self, *args, **kwargs):
        if active() and kernel.applies(*args, **kwargs):
            return kernel.fast(reference, *args, **kwargs)
        return reference(*args, **kwargs)

    forward.reference = reference
    func.forward = types.MethodType(forward, func)  # bound, as `kernels` expects of a slot's forward


def hook_global(home, kernel: Kernel) -> None:
    """Replace `home.<kernel.legacy>` by the same dispatch as `hook` (once; the reference is kept)."""
    current = getattr(home, kernel.legacy)
    reference = getattr(current, "reference", current)

    def dispatch(*args, **kwargs):
        if active() and kernel.applies(*args, **kwargs):
            return kernel.fast(reference, *args, **kwargs)
        return reference(*args, **kwargs)

    dispatch.reference = reference
    setattr(home, kernel.legacy, dispatch)


def unhook_global(home, name: str) -> None:
    reference = getattr(getattr(home, name, None), "reference", None)
    if reference is not None:
        setattr(home, name, reference)

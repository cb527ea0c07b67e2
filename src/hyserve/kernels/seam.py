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

Every attribute a kernel replaces or adds (a layer's `forward`, a slot's `forward`, a module-level
function, the data a kernel hangs on a layer) is set through one registry (`Patches`), which records
what was there, by which kernel, so that one call puts it back: `revert(model, kernel)` for one kernel
(the load-time check switching it off), `revert_all(model)` for every kernel. A model's patches live on
the model (`patches(model)`); module-level functions are process-wide (`GLOBAL`).
"""

from __future__ import annotations

import contextlib
import sys
import threading
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

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


MISSING = object()  # `Patch.original` of an attribute the owner's own __dict__ did not hold (its class's)


@dataclass(frozen=True)
class Patch:
    """`owner.name` replaced by `kernel`: `original` is what the owner's own __dict__ held (MISSING: nothing,
    an instance then reads its class's), `value` what hyserve put there; `undo`, for a change that is not an
    attribute (the model's attention implementation), puts it back instead."""

    kernel: str
    owner: Any
    name: str
    original: Any
    value: Any
    undo: Callable[[], None] | None = None

    def revert(self) -> None:
        if self.undo is not None:
            self.undo()
        elif self.original is MISSING:
            self.owner.__dict__.pop(self.name, None)
        else:
            setattr(self.owner, self.name, self.original)


class Patches:
    """The attributes hyserve's kernels replaced, in order, each with the original it first replaced (setting
    one again keeps that original), revertible by kernel or all at once (newest first)."""

    def __init__(self) -> None:
        self._items: dict[tuple[int, str], Patch] = {}

    def set(self, kernel: str, owner, name: str, value) -> None:
        """`owner.name = value`, recorded for `kernel`."""
        key = (id(owner), name)
        had = self._items.get(key)
        original = had.original if had is not None else owner.__dict__.get(name, MISSING)
        self._items.pop(key, None)  # re-added last: reverts run newest first
        self._items[key] = Patch(kernel, owner, name, original, value)
        setattr(owner, name, value)

    def change(self, kernel: str, owner, name: str, undo: Callable[[], None]) -> None:
        """Record a change made by other means than an attribute (`undo` reverses it)."""
        key = (id(owner), name)
        if key not in self._items:
            self._items[key] = Patch(kernel, owner, name, MISSING, None, undo)

    def original(self, owner, name: str):
        """`owner.name` as it was before any patch (MISSING: not in the owner's own __dict__)."""
        had = self._items.get((id(owner), name))
        return had.original if had is not None else owner.__dict__.get(name, MISSING)

    def __iter__(self):
        return iter(list(self._items.values()))

    def kernels(self) -> set[str]:
        return {p.kernel for p in self._items.values()}

    def revert(self, kernel: str | None = None, where: Callable[[Patch], bool] = lambda p: True) -> int:
        """Put back every patch of `kernel` (None: of every kernel) that `where` selects, newest first;
        returns how many."""
        done = 0
        for key, p in reversed(list(self._items.items())):
            if (kernel is None or p.kernel == kernel) and where(p):
                p.revert()
                del self._items[key]
                done += 1
        return done


GLOBAL = Patches()  # module-level functions replaced process-wide (`hook_global`)
_OWN = "_hyserve_patches"


def patches(model) -> Patches:
    """The registry of `model`'s patches (kept on the model, so it goes with it)."""
    own = model.__dict__.get(_OWN)
    if own is None:
        own = model.__dict__[_OWN] = Patches()
    return own


def _homes(model) -> set[int]:
    return {id(sys.modules.get(type(m).__module__)) for m in model.modules()}


def revert(model, kernel: str) -> None:
    """Switch `kernel` off for `model`: its patches on the model, and its process-wide ones in the modeling
    modules of `model`'s layers (off for every model of that family)."""
    patches(model).revert(kernel)
    homes = _homes(model)
    GLOBAL.revert(kernel, lambda p: id(p.owner) in homes)


def revert_all(model) -> None:
    """Put transformers' own functions back everywhere in `model` (and process-wide in its modeling modules)."""
    patches(model).revert()
    homes = _homes(model)
    GLOBAL.revert(None, lambda p: id(p.owner) in homes)


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


def hook(func, kernel: Kernel, registry: Patches) -> None:
    """Make the slot `func` run `kernel` where it applies (on the model thread), its old forward elsewhere."""
    reference = reference_of(func)

    def forward(_self, *args, **kwargs):
        if active() and kernel.applies(*args, **kwargs):
            return kernel.fast(reference, *args, **kwargs)
        return reference(*args, **kwargs)

    forward.reference = reference
    registry.set(kernel.name, func, "forward", types.MethodType(forward, func))  # bound, as `kernels` expects


def hook_global(home, kernel: Kernel) -> None:
    """Replace `home.<kernel.legacy>` by the same dispatch as `hook`, process-wide (`GLOBAL`)."""
    current = getattr(home, kernel.legacy)
    reference = getattr(current, "reference", current)

    def dispatch(*args, **kwargs):
        if active() and kernel.applies(*args, **kwargs):
            return kernel.fast(reference, *args, **kwargs)
        return reference(*args, **kwargs)

    dispatch.reference = reference
    if (
        GLOBAL.original(home, kernel.legacy) is current
    ):  # (a hook a dropped registry left: its reference is the original)
        setattr(home, kernel.legacy, reference)
    GLOBAL.set(kernel.name, home, kernel.legacy, dispatch)


def unhook_global(home, kernel: Kernel) -> None:
    """Put `home.<kernel.legacy>` back (process-wide: off for every model of this family)."""
    GLOBAL.revert(kernel.name, lambda p: p.owner is home)
    current = getattr(home, kernel.legacy, None)
    if getattr(current, "reference", None) is not None:  # hooked by a registry since dropped
        setattr(home, kernel.legacy, current.reference)

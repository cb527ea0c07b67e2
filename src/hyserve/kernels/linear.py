"""Linear layers: bfloat16 weights packed once for oneDNN (`pack`), their products of a few rows in C once
checked (`install_native`), and skinny float32 rows for a decode batch. For a few dozen rows, MKL's x @ W^T with
row-major float32 weights is slower than the same product taken as (W @ x^T)^T (`benchmarks/bench_kernels.py --micro`
times both); a batched decode step runs one row per request through every layer. The result is returned as that
transposed view (rows stay contiguous among themselves, so every reshape the models do still works): making it
contiguous cost a quarter of the product.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from . import seam, verify
from .seam import active

SKINNY_ROWS = range(13, 49)  # rows for which (W @ x^T)^T beats F.linear on the CPUs measured


PACKED = "_hyserve_packed"  # the module attribute holding its weight in oneDNN's layout


class Packed:
    """A bfloat16 weight ready for products: oneDNN's blocked layout (`onednn`), reordered once, and the
    row-major weight (`plain`), which the C product (`native.Products`) streams for a few rows once
    `install_native` has checked it (`native`)."""

    def __init__(self, plain: torch.Tensor):
        self.plain = plain
        self.onednn = torch.ops.mkldnn._reorder_linear_weight(plain, 1)
        self.native = None

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x @ W^T (+ bias): oneDNN's product is bit for bit `F.linear`'s; the C product's sums run in
        another order."""
        if self.native is not None and bias is None and (y := self.native(x, self.plain)) is not None:
            return y
        return packed_product(x, self, bias)


def pack(module: torch.nn.Linear, registry: seam.Patches | None = None) -> bool:
    """Keep a bfloat16 weight also in oneDNN's blocked layout, reordered once (`Packed`). `F.linear` on bfloat16
    runs the same oneDNN product but reorders the weight on every call: a decode step (one row) then streamed
    the weights at about a third of the memory bandwidth the packed product reaches, the 248k-row head of a
    Qwen3.5 included (`benchmarks/bench_kernels.py --micro`). The results are bit-identical to `F.linear`'s.
    The plain weight stays (tied embeddings, transformers' own functions), so weights take twice the memory;
    `HYSERVE_PACKED_LINEAR=0` switches this off. Returns whether the module is packed (recorded in `registry`,
    the model's `seam.patches`, as the "linear" kernel's)."""
    if (
        module.weight.dtype != torch.bfloat16
        or module.weight.device.type != "cpu"
        or os.environ.get("HYSERVE_PACKED_LINEAR", "1") == "0"
        or not torch.backends.mkldnn.is_available()
    ):
        return False
    try:
        packed = Packed(module.weight.detach())
    except (RuntimeError, AttributeError):  # a CPU or build without oneDNN's bfloat16 products
        return False
    (registry if registry is not None else seam.Patches()).set("linear", module, PACKED, packed)
    return True


def packed_product(x: torch.Tensor, packed: Packed, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ W^T (+ bias) over a weight `pack` reordered for oneDNN: bit for bit `F.linear`'s result."""
    return torch.ops.mkldnn._linear_pointwise(x, packed.onednn, bias, "none", [], "")


def every_packed(model) -> list[Packed]:
    """The packed weights of `model`'s linear layers and sibling groups, each once."""
    found = {}
    for module in model.modules():
        for packed in (module.__dict__.get(PACKED), getattr(module.__dict__.get(GROUP), "packed", None)):
            if packed is not None:
                found[id(packed)] = packed
    return list(found.values())


def install_native(model, products) -> str:
    """Let `products` (`native.Products`) take the products of a few rows over every packed weight of `model`
    once it gives oneDNN's results on probes of the first and the last (the head); "" when on, else why not."""
    weights = every_packed(model)
    if not weights:
        return "no packed bfloat16 weights"
    if not products.usable():
        return "this CPU or compiler has no AVX512-BF16 products"
    g = torch.Generator().manual_seed(0)
    for packed in {id(p): p for p in (weights[0], weights[-1])}.values():
        for rows in (1, products.ROWS):
            x = torch.randn(rows, 1, packed.plain.shape[1], generator=g).to(torch.bfloat16)
            got, want = products(x, packed.plain), packed_product(x, packed)
            if got is None:
                return "does not apply to this model's weights"
            if why := verify.mismatch(got, want, torch.bfloat16):
                return why
    registry = seam.patches(model)
    for packed in weights:
        registry.set("native_linear", packed, "native", products)
    return ""


# Linear layers of one module that every model calls on the same input, one after the other (a Gated DeltaNet
# layer's input projections, attention's q/k/v, an MLP's gate and up).
SIBLINGS = (
    ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"),
    ("in_proj_qkvz", "in_proj_ba"),
    ("q_proj", "k_proj", "v_proj"),
    ("gate_proj", "up_proj"),
)
GROUP = "_hyserve_group"


class Siblings:
    """Linear layers that read the same input, as one product over their weights stacked: `product(x)` gives
    every member's columns (`columns[id(member)]`) at once.

    A decode step's products are one row against each weight: a Qwen3.5 Gated DeltaNet layer ran four, two of
    them 16 x 1024, each paying a call's fixed cost and streaming its weight at a fraction of the bandwidth a
    larger one reaches. The first member called with an input runs the stacked product and keeps it until
    every member has read its columns of it (a view); a member called with another tensor runs the stacked
    product for that one. (The models call the siblings back to back on one input that nothing changes in
    between; inference tensors keep no version counter to check that by.) Each column is the same dot
    product either way: the load-time check requires the stacked result to equal the members' own, bit for
    bit. `dtypes`: the inputs the stacked product takes (others run each member's own product)."""

    dtypes: tuple[torch.dtype, ...] = ()

    def __init__(self, members: list[torch.nn.Module]):
        self.columns, start = {}, 0
        for m in members:
            self.columns[id(m)] = (start, start + m.out_features)
            start += m.out_features
        self.size = len(members)
        self._last = None  # [input, stacked output, reads left]

    def product(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def output(self, module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        last = self._last
        if last is None or last[0] is not x:
            last = [x, self.product(x), self.size]
        last[2] -= 1
        self._last = last if last[2] else None  # the last member's read lets the input and output go
        a, b = self.columns[id(module)]
        return last[1][..., a:b]


class SiblingGroup(Siblings):
    """Packed bfloat16 siblings (`pack`): their weights stacked and packed once, each member's weight a view of
    the stack (held once)."""

    dtypes = (torch.bfloat16,)

    def __init__(self, members: list[torch.nn.Linear]):
        super().__init__(members)
        weight = torch.cat([m.weight.detach() for m in members])
        self.packed = Packed(weight)
        for m in members:
            a, b = self.columns[id(m)]
            m.weight.data = weight[a:b]  # a view of the stack: held once

    def product(self, x: torch.Tensor) -> torch.Tensor:
        return self.packed(x)


def grouping_enabled() -> bool:
    """Whether sibling layers may be stacked (`HYSERVE_GROUPED_LINEAR=0`: each runs its own product)."""
    return os.environ.get("HYSERVE_GROUPED_LINEAR", "1") != "0"


def group(model) -> list[SiblingGroup]:
    """Stack the packed, bias-free sibling layers (`SIBLINGS`) of every module of `model` into groups
    (none with `HYSERVE_GROUPED_LINEAR=0`)."""
    made = []
    if not grouping_enabled():
        return made
    registry = seam.patches(model)
    for parent in model.modules():
        for names in SIBLINGS:
            members = [getattr(parent, n, None) for n in names]
            if (
                not all(type(m) is torch.nn.Linear and PACKED in m.__dict__ and m.bias is None for m in members)
                or len({m.in_features for m in members}) != 1
            ):
                continue
            g = SiblingGroup(members)
            for m in members:
                registry.set("linear", m, GROUP, g)
            made.append(g)
    return made


def settle(model) -> None:
    """Grouped members no longer need their own packed weights (the group's stack holds them): free them."""
    seam.patches(model).revert("linear", lambda p: p.name == PACKED and GROUP in p.owner.__dict__)


def ungroup(model) -> None:
    seam.patches(model).revert("linear", lambda p: p.name == GROUP)


def linear_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """`nn.Linear.forward`, except on the model thread: a packed bfloat16 weight (`pack`) runs its product
    without reordering, and a skinny float32 CPU input takes the faster product order."""
    siblings = self.__dict__.get(GROUP)
    if siblings is not None and x.dtype == torch.bfloat16 and x.device.type == "cpu" and active():
        return siblings.output(self, x)
    packed = self.__dict__.get(PACKED)
    if packed is not None and x.dtype == torch.bfloat16 and x.device.type == "cpu" and active():
        return packed(x, self.bias)
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if rows in SKINNY_ROWS and x.dtype == torch.float32 and x.device.type == "cpu" and active():
        y = torch.mm(self.weight, x.reshape(rows, x.shape[-1]).t()).t()
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)  # a transposed view: see the module docstring
    return F.linear(x, self.weight, self.bias)


def probe(linear: torch.nn.Linear, seed: int = 0) -> torch.Tensor:
    """A skinny input of `linear`'s own width for the load-time check."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(SKINNY_ROWS.start + 3, linear.in_features, generator=g).to(linear.weight)

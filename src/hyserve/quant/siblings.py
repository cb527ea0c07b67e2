"""Quantized sibling projections (`kernels.linear.SIBLINGS`: a Gated DeltaNet's input projections, attention's
q/k/v, an MLP's gate and up) as one product over their blocks stacked, as `kernels.linear.group` stacks bfloat16
ones.

A decode step of a quantized model ran each sibling's C product apart: one call, one rounding of the same input
(w8a8 / w4a8) and one parallel region each, four of them in a Qwen3.5 Gated DeltaNet layer, two of those 16 rows
long. Stacked, a layer's products take half the calls. Each output row of the C products is the same dot product
whichever rows share its call (`quant/products.c`, `quant/a8_products.c`), so the stack's columns equal the
members' own products bit for bit; `group` requires that on probes before it keeps the groups. The members' values
and scales become views of the stack (held once).
"""

from __future__ import annotations

import logging

import torch

from ..kernels import decode_layer, linear, seam
from .layout import QuantLinear, format_of

log = logging.getLogger("hyserve.quant")

KERNEL = "quant_siblings"  # the name its patches are recorded under (`kernels.seam`)


class QuantSiblings(linear.Siblings):
    """`QuantLinear`s of one format, input width and product that read the same input: one `QuantLinear` over
    their rows (`stacked`, its bias the members' biases end to end), the members' values and scales its views."""

    dtypes = (torch.float32, torch.bfloat16, torch.float16)

    def __init__(self, members: list[QuantLinear]):
        super().__init__(members)
        first = members[0]
        qs, d = torch.cat([m.qs for m in members]), torch.cat([m.d for m in members])
        bias = None if first.bias is None else torch.cat([m.bias.detach() for m in members])
        self.stacked = QuantLinear(qs, d, bias, first.dtype)
        self.stacked.rounds_activations, self.stacked.native = first.rounds_activations, first.native
        self.stacked.interleaved = first.interleaved  # (whole sets each: the stack's sets are the members')
        for m in members:
            a, b = self.columns[id(m)]
            m.qs, m.d = qs[a:b], d[a:b]  # views of the stack: held once
            if bias is not None:
                m.bias.data = bias[a:b]

    def product(self, x: torch.Tensor) -> torch.Tensor:
        return self.stacked.own(x)  # (not through `nn.Module.__call__`: no hooks are ever put on it)


def _alike(members: list) -> bool:
    """Whether `members` can share one product: all `QuantLinear`s of one input width, format, dtype, activation
    rounding, held order and C product, all with a bias or none."""
    if not all(type(m) is QuantLinear for m in members):
        return False
    keys = {
        (
            m.in_features,
            format_of(m.qs, m.d),
            m.dtype,
            m.rounds_activations,
            m.interleaved,
            id(m.native),
            m.bias is None,
        )
        for m in members
    }
    return len(keys) == 1


def group(model) -> int:
    """Stack the quantized siblings of every module of `model` (`QuantSiblings`) once the first group's columns
    equal its members' own products bit for bit, for a decode row, a decode batch and a short prefill piece; then
    the lean decode layers take the stacks (`decode_layer.restack`). Returns how many groups were made (0 with
    `HYSERVE_GROUPED_LINEAR=0`, or when the check failed: the members' values then stay views, computed apart)."""
    made = []
    if not linear.grouping_enabled():
        return 0
    registry = seam.patches(model)
    for parent in model.modules():
        for names in linear.SIBLINGS:
            members = [getattr(parent, n, None) for n in names]
            if not _alike(members):
                continue
            siblings = QuantSiblings(members)
            for m in members:
                registry.set(KERNEL, m, linear.GROUP, siblings)
            made.append((siblings, members))
    if not made:
        return 0
    siblings, members = made[0]
    g = torch.Generator().manual_seed(0)
    for rows in (1, 8, 19):
        x = torch.randn(rows, 1, members[0].in_features, generator=g).to(members[0].dtype)
        with torch.inference_mode():
            got = siblings.product(x)
            if not all(torch.equal(got[..., slice(*siblings.columns[id(m)])], m.own(x)) for m in members):
                seam.revert(model, KERNEL)
                log.info("quantized sibling projections left apart: their stacked product differs from their own")
                return 0
    decode_layer.restack(model)
    return len(made)

"""The routed experts of a MoE block held as Q8_0 / Q4_0 blocks: transformers' fused 3-D expert weights
(`gate_up_proj` [experts, 2 x intermediate, hidden] or `up_proj`, and `down_proj`), each expert's slice quantized
as a linear layer's weight is (`layout.quantize`, blocks along its input dimension).

`QuantExperts` takes the place of transformers' experts module (`@use_experts_implementation`: Qwen3-Next,
Qwen3.5-MoE, Nemotron-H, Granite 4.0-H, LFM2-MoE, Jamba) and computes what its eager loop computes, over the
quantized weights. A token's result does not depend on its batch: each expert's rows run the product a
`QuantLinear` runs (the C product, each row as it would be alone; dequantize-then-matmul in float32 for an
expert that many rows hit), and a token's top-k outputs are added in its own slot order in float32 with
elementwise operations, rounded once to the activation's dtype.

A prefill piece hits each expert with a few rows: up to `C_ROWS` of them run the C product `Products.ROWS` at a
time (under w8a8 / w4a8 any number, in one call), streaming the expert's quantized values, rather than
dequantizing the whole expert for them (each prefill
piece would otherwise dequantize every expert it hits); the (token, slot) pairs are grouped by expert with one
sort, not one comparison over every pair per expert.
"""

from __future__ import annotations

import torch

from ..kernels.seam import active
from .layout import BLOCK, QuantLinear, quantize

C_ROWS = 16  # an expert hit by more rows dequantizes its weights once and multiplies in float32


def fused_weights(module) -> tuple[str, str] | None:
    """The names of (the up or gate-up, the down) 3-D weights of a transformers experts module this file can hold
    quantized, or None when the module is not one (another layout, biases, a gate of its own, a norm after
    each expert)."""
    if not hasattr(module, "has_gate") or not isinstance(getattr(module, "down_proj", None), torch.Tensor):
        return None
    if (
        getattr(module, "is_transposed", False)
        or getattr(module, "has_bias", False)
        or getattr(module, "has_post_expert_norm", False)
        or not getattr(module, "is_concatenated", True)
    ):
        return None
    up = "gate_up_proj" if module.has_gate else "up_proj"
    if not isinstance(getattr(module, up, None), torch.Tensor):
        return None
    if module.has_gate:
        from transformers.integrations.moe import _default_apply_gate

        if getattr(type(module), "_apply_gate", _default_apply_gate) is not _default_apply_gate:
            return None
    if any(getattr(module, n).dim() != 3 for n in (up, "down_proj")):
        return None
    return up, "down_proj"


def fits_blocks(module) -> bool:
    names = fused_weights(module)
    return names is not None and all(getattr(module, n).shape[-1] % BLOCK == 0 for n in names)


def quantize_3d(weight: torch.Tensor, scheme: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, scales) of fused expert weights [experts, n, k], each expert's slice quantized as a linear layer's."""
    experts, n, k = weight.shape
    qs, d = quantize(weight.reshape(experts * n, k), scheme)
    return qs.view(experts, n, -1), d.view(experts, n, -1)


class QuantExperts(torch.nn.Module):
    """A MoE block's routed experts over quantized weights: `forward(hidden_states [tokens, hidden],
    top_k_index [tokens, k], top_k_weights [tokens, k])` as transformers' experts modules."""

    def __init__(self, module, scheme: str):
        super().__init__()
        up, down = fused_weights(module)
        self.num_experts = module.num_experts
        self.has_gate = module.has_gate
        self.act_fn = module.act_fn
        self.dtype = getattr(module, down).dtype
        for name, weight in (("up", getattr(module, up)), ("down", getattr(module, down))):
            qs, d = quantize_3d(weight, scheme)
            self.register_buffer(f"{name}_qs", qs)
            self.register_buffer(f"{name}_d", d)
        self.hidden_dim = self.down_d.shape[1]
        self._views()

    def _views(self) -> None:
        """Per expert a `QuantLinear` over its slice of the 3-D tensors (views: held once), not registered as
        submodules, so that the state dict and `modules()` see the 3-D tensors only."""
        self.up = [QuantLinear(self.up_qs[e], self.up_d[e], None, self.dtype) for e in range(self.num_experts)]
        self.down = [QuantLinear(self.down_qs[e], self.down_d[e], None, self.dtype) for e in range(self.num_experts)]

    def linears(self) -> list[QuantLinear]:
        return [*self.up, *self.down]

    @classmethod
    def from_blocks(cls, module, up: tuple[torch.Tensor, torch.Tensor], down: tuple[torch.Tensor, torch.Tensor]):
        """Over blocks already made, (values, scales) of each weight as `quantize_3d` makes them: a GGUF file's,
        held as they are (`gguf.loader`). `module` is the experts module they are the weights of (its weights may
        be on the meta device)."""
        held = cls.__new__(cls)
        torch.nn.Module.__init__(held)
        held.num_experts, held.has_gate, held.act_fn = module.num_experts, module.has_gate, module.act_fn
        held.dtype = getattr(module, fused_weights(module)[1]).dtype
        for name, (qs, d) in (("up", up), ("down", down)):
            held.register_buffer(f"{name}_qs", qs)
            held.register_buffer(f"{name}_d", d)
        held.hidden_dim = held.down_d.shape[1]
        held._views()
        return held

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        tokens, k = top_k_index.shape
        pairs = torch.zeros(tokens * k, self.hidden_dim, dtype=x.dtype)  # each (token, slot)'s weighted output
        weights = top_k_weights.reshape(-1)
        for e, at in self._hits(top_k_index.reshape(-1)):
            h = _rows_through(self.up[e], x[at // k])
            if self.has_gate:
                gate, up = h.chunk(2, dim=-1)
                h = self.act_fn(gate) * up
            else:
                h = self.act_fn(h)
            pairs[at] = (_rows_through(self.down[e], h) * weights[at, None]).to(x.dtype)
        pairs = pairs.view(tokens, k, self.hidden_dim)
        out = pairs[:, 0].float()
        for slot in range(1, k):
            out = out + pairs[:, slot].float()
        return out.to(hidden_states.dtype).view(hidden_states.shape)

    def _hits(self, flat: torch.Tensor):
        """(expert, the indices of the (token, slot) pairs routed to it, in order) for each expert hit, from one
        stable sort; expert parallelism's sentinel (an index outside the experts) is left out: nothing to add."""
        key = torch.where((flat >= 0) & (flat < self.num_experts), flat, self.num_experts)
        order = torch.argsort(key, stable=True)
        counts = torch.bincount(key, minlength=self.num_experts + 1)[: self.num_experts].tolist()
        start = 0
        for e, count in enumerate(counts):
            if count:
                yield e, order[start : start + count]
            start += count

    def extra_repr(self) -> str:
        fmt = "q4_0" if self.up_qs.dtype == torch.uint8 else "q8_0"
        return f"experts={self.num_experts}, hidden={self.hidden_dim}, gated={self.has_gate}, {fmt}, {self.dtype}"


def quantized_linears(model) -> list[QuantLinear]:
    """Every `QuantLinear` of `model`, each routed expert's included (`QuantExperts.linears`)."""
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    return layers + [linear for m in model.modules() if isinstance(m, QuantExperts) for linear in m.linears()]


def _rows_through(layer: QuantLinear, x: torch.Tensor) -> torch.Tensor:
    """`layer(x)`, with up to `C_ROWS` rows given to its C product `ROWS` at a time (each row's result is the
    one it gets alone) instead of dequantizing the whole weight for them; more rows take `layer`'s own choice."""
    products = layer.native
    if products is None or not active() or x.shape[0] <= products.ROWS or x.shape[0] > C_ROWS:
        return layer(x)
    return torch.cat([layer(part) for part in x.split(products.ROWS)])

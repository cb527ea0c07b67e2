"""Qwen3.5's decoder layers (Gated DeltaNet or full attention, then the MLP) for one decode token, without
the module dispatch around their operations.

A decode step is bound by streaming the weights through the products, and everything between the products
is the overhead the step adds to that: per layer transformers' decoder layer calls a dozen submodules
through `nn.Module.__call__`, each wrapped in its decorators, and recomputes constants of the layer
(the Gated DeltaNet's decay rate, its conv taps in float32) on every token. For one token per row, this
forward (`decode_forward`) runs the same operations in the same order on the same kernels (the grouped
products, `conv_step`, `recurrent_step`, the norms' forms) straight from the layer's parts, with those
constants taken once at load (`Parts`). Anything else (a prefill piece, no cache, a cache that records its
past, another keyword) runs the layer's own forward, as does every call off the model thread. The
load-time model check covers it like every kernel; `benchmarks/bench_decode_step.py` measures a step with
it and with the layers' own forward, in one process; `HYSERVE_DECODE_LAYER=0` switches it off.

In bfloat16 models the Gated DeltaNet's part between its two products (`gdn_between_products`) runs as one
C call instead (`install_native`, `native.GdnStep`), once it has given those operations' results on probes.
Over int8-activation quantized weights (w8a8 / w4a8), whose products are C functions too, the MLP block and the
whole Gated DeltaNet layer each run as one C call (`install_fused`): in a small model the Python between a step's
hundred products is a large share of the step.
"""

from __future__ import annotations

import functools
import os
import sys
import types

import torch
import torch.nn.functional as F

from . import linear, native, norm, seam, verify
from .seam import active

PARTS = "_hyserve_decode_parts"
# The mixers whose forward `decode_forward` reproduces, by class: another class with the same parts may do
# other math (Qwen3-Next orders its projections otherwise), so it keeps its own forward.
GATED_DELTANET = ("Qwen3_5GatedDeltaNet", "Qwen3_5MoeGatedDeltaNet")
ATTENTION = ("Qwen3_5Attention", "Qwen3_5MoeAttention")


class Stack:
    """Linear layers that read the same input, as one product: their sibling group's stacked product
    (`linear.Siblings`: bfloat16 weights stacked by `linear.group`, quantized ones by `quant.siblings`), or a lone
    layer's packed weight (`linear.pack`), for an input of a dtype it takes (each member's columns a view of
    it); else each member's own forward."""

    def __init__(self, members: list[torch.nn.Module]):
        self.members = members
        group = members[0].__dict__.get(linear.GROUP)
        self.product, self.columns, self.dtypes = None, None, ()
        if (
            group is not None
            and group.size == len(members)
            and all(m.__dict__.get(linear.GROUP) is group for m in members)
        ):
            self.product, self.dtypes = group.product, group.dtypes
            self.columns = [group.columns[id(m)] for m in members]
        elif len(members) == 1 and linear.PACKED in members[0].__dict__:
            self.product = functools.partial(members[0].__dict__[linear.PACKED], bias=members[0].bias)
            self.dtypes = (torch.bfloat16,)

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        if self.product is not None and x.dtype in self.dtypes:
            y = self.product(x)
            return [y[..., a:b] for a, b in self.columns] if self.columns else [y]
        return [m.forward(x) for m in self.members]

    def one(self, x: torch.Tensor) -> torch.Tensor:
        return self(x)[0]

    def c_product(self) -> tuple[native.CProduct, list[tuple[int, int]]] | None:
        """(its one product as C code calls it, each member's columns in that product's output), where the
        product has such a form (`QuantLinear.c_product`: int8-activation quantized weights); else None."""
        group = self.members[0].__dict__.get(linear.GROUP)
        if self.columns:
            target = getattr(group, "stacked", None)
        else:
            target = self.members[0] if len(self.members) == 1 and group is None else None
        form = getattr(target, "c_product", None)
        product = form() if form is not None else None
        if product is None:
            return None
        return product, self.columns or [(0, product.n)]


def _linear(module) -> bool:
    """A plain `nn.Linear`, or a module that stands for one (`linear_like`: a quantized linear layer)."""
    return type(module) is torch.nn.Linear or getattr(type(module), "linear_like", False)


def _norm(module):
    """A norm's form (`norm.install`) bound to it, else its forward."""
    form = getattr(module.__dict__.get("forward"), "form", None)
    return functools.partial(form, module) if form is not None else module.forward


class Parts:
    """What `decode_forward` takes from one decoder layer, gathered once: its norms' and products' forwards,
    for a Gated DeltaNet its constants in float32, for attention the functions its modeling file uses."""

    def __init__(self, layer, conv_step, recurrent_step):
        self.conv_step, self.recurrent_step = conv_step, recurrent_step
        self.norm_in, self.norm_post = _norm(layer.input_layernorm), _norm(layer.post_attention_layernorm)
        self.gdn = self.attn = self.native = None
        gdn, attn = getattr(layer, "linear_attn", None), getattr(layer, "self_attn", None)
        self.index = (gdn if gdn is not None else attn).layer_idx
        if type(gdn).__name__ in GATED_DELTANET and conv_step is not None and recurrent_step is not None:
            self.gdn = gdn
            self.neg_a = -gdn.A_log.detach().float().exp()  # as transformers: -A_log.float().exp()
            self.dt_bias = gdn.dt_bias.detach().float()  # a.float() + dt_bias promotes it to float32 anyway
            self.taps = gdn.conv1d.weight.detach().squeeze(1).float()  # conv_step's products run in float32
            self.conv_bias = gdn.conv1d.bias
            self.dims = (gdn.key_dim, gdn.value_dim, gdn.num_k_heads, gdn.head_k_dim, gdn.num_v_heads, gdn.head_v_dim)
            self.gated_norm = _norm(gdn.norm)
        home = sys.modules.get(type(attn).__module__)
        if type(attn).__name__ in ATTENTION and all(
            hasattr(home, n) for n in ("ALL_ATTENTION_FUNCTIONS", "apply_rotary_pos_emb", "eager_attention_forward")
        ):
            self.attn = attn
            self.q_norm, self.k_norm = _norm(attn.q_norm), _norm(attn.k_norm)
            self.rotary, self.interfaces = home.apply_rotary_pos_emb, home.ALL_ATTENTION_FUNCTIONS
            self.eager = home.eager_attention_forward
        self.stack(layer)

    def stack(self, layer) -> None:
        """The layer's products (`Stack`s), as its linear layers are grouped now: again after a later grouping
        (`restack`)."""
        mlp = layer.mlp
        self.mlp, self.fused, self.mlp_native = None, None, None  # (the C forms: `install_fused`, after this)
        self.silu = type(getattr(mlp, "act_fn", None)).__name__ in ("SiLUActivation", "SiLU")
        if all(_linear(getattr(mlp, n, None)) for n in ("gate_proj", "up_proj", "down_proj")):
            self.mlp = (Stack([mlp.gate_proj, mlp.up_proj]), mlp.act_fn.forward, Stack([mlp.down_proj]).one)
        if self.gdn is not None:
            gdn = self.gdn
            self.in_proj = Stack([gdn.in_proj_qkv, gdn.in_proj_z, gdn.in_proj_b, gdn.in_proj_a])
            self.out_proj = Stack([gdn.out_proj]).one
        if self.attn is not None:
            attn = self.attn
            self.qkv = Stack([attn.q_proj, attn.k_proj, attn.v_proj])
            self.o_proj = Stack([attn.o_proj]).one


def fits(layer) -> bool:
    """Whether `layer` is a decoder layer of the shape `decode_forward` is written for (Qwen3.5's, dense or
    MoE: a Gated DeltaNet or full-attention block, then an MLP or MoE block) with no hooks on any part
    (offloading's would be skipped)."""
    if not all(hasattr(layer, n) for n in ("input_layernorm", "post_attention_layernorm", "mlp")):
        return False
    mixer = {"linear_attention": "linear_attn", "full_attention": "self_attn"}.get(getattr(layer, "block_type", None))
    if mixer is None or not hasattr(layer, mixer):
        return False
    return not any(m._forward_hooks or m._forward_pre_hooks or hasattr(m, "_hf_hook") for m in layer.modules())


def _gdn_step(p: Parts, x: torch.Tensor, cache) -> torch.Tensor | None:
    """The Gated DeltaNet for one token per row, as transformers' forward runs it with hyserve's kernels;
    None where that forward takes another path (no state yet)."""
    idx = p.index
    conv_state = cache.get_conv_state(idx, state_idx=0)
    recurrent = cache.get_recurrent_state(idx, state_idx=0)
    if conv_state is None or recurrent is None:
        return None
    mixed, z, b, a = p.in_proj(x)
    out = p.native(mixed, z, b, a, conv_state, recurrent) if p.native is not None else None
    if out is None:
        out, state = gdn_between_products(p, mixed, z, b, a, conv_state, recurrent)
        if state is not recurrent:  # updated in place when it could be; else handed to the cache as transformers does
            cache.update_recurrent_state(state, idx)
    if hasattr(cache, "increase_count"):  # transformers >= 5.25 counts the tokens of an in-place conv step
        cache.increase_count(idx, 0)
    return p.out_proj(out)


def _fused_gdn(p: Parts, hidden_states, cache) -> torch.Tensor | None:
    """The whole Gated DeltaNet layer in one C call (`native.GdnLayer`), or None (nothing changed) where it does
    not apply (no state yet, inputs of another form)."""
    idx = p.index
    conv_state = cache.get_conv_state(idx, state_idx=0)
    recurrent = cache.get_recurrent_state(idx, state_idx=0)
    if conv_state is None or recurrent is None:
        return None
    out = p.fused(hidden_states, conv_state, recurrent)
    if out is not None and hasattr(cache, "increase_count"):
        cache.increase_count(idx, 0)
    return out


def gdn_between_products(p: Parts, mixed, z, b, a, conv_state, recurrent):
    """The Gated DeltaNet's step between its products, in PyTorch operations: the conv step (conv state
    updated in place), the delta rule, the gated norm. Returns (the out-projection's input [rows, 1, value_dim],
    the new recurrent state: `recurrent` itself where updated in place)."""
    key_dim, value_dim, hk, dk, hv, dv = p.dims
    rows = mixed.shape[0]
    mixed = p.conv_step(None, mixed.transpose(1, 2), conv_state, p.taps, p.conv_bias, activation="silu").transpose(1, 2)
    q = mixed[..., :key_dim].reshape(rows, 1, hk, dk)
    k = mixed[..., key_dim : 2 * key_dim].reshape(rows, 1, hk, dk)
    v = mixed[..., 2 * key_dim :].reshape(rows, 1, hv, dv)
    g = p.neg_a * F.softplus(a.float() + p.dt_bias)
    out, state = p.recurrent_step(
        None, q, k, v, g, b.sigmoid(), initial_state=recurrent, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    out = p.gated_norm(out.reshape(-1, dv), z.reshape(-1, dv))
    return out.reshape(rows, 1, value_dim), state


def _attention_step(p: Parts, x, position_embeddings, attention_mask, cache, kwargs) -> torch.Tensor:
    """Qwen3.5's gated full attention for one token per row, as its forward runs it."""
    attn = p.attn
    rows, head_dim = x.shape[0], attn.head_dim
    query, key, value = p.qkv(x)
    query, gate = torch.chunk(query.view(rows, 1, -1, head_dim * 2), 2, dim=-1)
    gate = gate.reshape(rows, 1, -1)
    query = p.q_norm(query.view(rows, 1, -1, head_dim)).transpose(1, 2)
    key = p.k_norm(key.view(rows, 1, -1, head_dim)).transpose(1, 2)
    value = value.view(rows, 1, -1, head_dim).transpose(1, 2)
    cos, sin = position_embeddings
    query, key = p.rotary(query, key, cos, sin)
    key, value = cache.update(key, value, attn.layer_idx, kwargs=kwargs)
    interface = p.interfaces.get_interface(attn.config._attn_implementation, p.eager)
    out, _ = interface(
        attn,
        query,
        key,
        value,
        attention_mask,
        dropout=attn.attention_dropout if attn.training else 0.0,
        scaling=attn.scaling,
        **kwargs,
    )
    out = out.reshape(rows, 1, -1).contiguous()
    out = out * torch.sigmoid(gate)
    return p.o_proj(out)


def decode_forward(
    self, hidden_states, position_embeddings=None, attention_mask=None, position_ids=None, cache=None, **kwargs
):
    """The decoder layer's forward: for one token per row on the model thread, the lean path; else its own."""
    out = None
    if hidden_states.shape[1] == 1 and cache is not None and "past_key_values" not in kwargs and active():
        out = _lean(
            self, self.__dict__[PARTS], hidden_states, position_embeddings, attention_mask, position_ids, cache, kwargs
        )
    if out is None:
        out = type(self).forward(
            self,
            hidden_states,
            position_embeddings=position_embeddings,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            **kwargs,
        )
    return out


def _lean(layer, p: Parts, hidden_states, position_embeddings, attention_mask, position_ids, cache, kwargs):
    """The layer for one token per row, or None (nothing changed yet) where its own forward must run: a Gated
    DeltaNet without its kernels or without a state yet, a cache that records its past."""
    linear_attention = layer.block_type == "linear_attention"
    if (linear_attention and p.gdn is None) or cache.is_recording_past(p.index):
        return None
    if linear_attention and p.fused is not None and attention_mask is None:
        if (out := _fused_gdn(p, hidden_states, cache)) is not None:
            return out
    x = p.norm_in(hidden_states)
    if linear_attention:
        if attention_mask is not None:  # transformers' apply_mask_to_padding_states
            x = (x * attention_mask[:, :, None]).to(x.dtype)
        mixed = _gdn_step(p, x, cache)
        if mixed is None:
            return None
    elif p.attn is not None:
        mixed = _attention_step(p, x, position_embeddings, attention_mask, cache, kwargs)
    else:
        mixed, _ = layer.self_attn(
            hidden_states=x,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            position_embeddings=position_embeddings,
            **kwargs,
        )
    hidden_states = hidden_states + mixed
    if p.mlp_native is not None and (out := p.mlp_native(hidden_states)) is not None:
        return out
    x = p.norm_post(hidden_states)
    if p.mlp is not None:
        stack, act, down = p.mlp
        gate, up = stack(x)
        x = down(act(gate) * up)
    else:
        x = layer.mlp(x)
        if isinstance(x, tuple):  # an MoE block's (output, router logits)
            x = x[0]
    return hidden_states + x


def install(model, conv_step=None, recurrent_step=None) -> int:
    """Give every decoder layer of `model` that `fits` the lean decode forward (on the model thread only;
    `HYSERVE_DECODE_LAYER=0` leaves them). Call after the linear and norm kernels are in place: it takes the
    forwards they installed. `conv_step`, `recurrent_step`: the `fast` functions of the conv-step and
    recurrent-step kernels that passed their checks (without both, Gated DeltaNet layers keep their own
    forward). Returns how many layers took it."""
    if os.environ.get("HYSERVE_DECODE_LAYER", "1") == "0":
        return 0
    done = 0
    registry = seam.patches(model)
    for module in model.modules():
        if "DecoderLayer" in type(module).__name__ and fits(module):
            registry.set("decode_layer", module, PARTS, Parts(module, conv_step, recurrent_step))
            registry.set("decode_layer", module, "forward", types.MethodType(decode_forward, module))
            done += 1
    return done


def restack(model) -> None:
    """Rebuild the lean layers' products after their linear layers were grouped anew (`quant.siblings`)."""
    for module in model.modules():
        if PARTS in module.__dict__:
            module.__dict__[PARTS].stack(module)


def install_native(model) -> str | None:
    """Give each Gated DeltaNet layer that took the lean forward the C step between its products
    (`native.GdnStep`), when it matches `gdn_between_products` on probes of the layer's shapes. Returns ""
    when it did, why not when it did not, None when there is nothing it is written for (no such layer, or
    not a bfloat16 model: nothing to report)."""
    parts = [m.__dict__[PARTS] for m in model.modules() if PARTS in m.__dict__]
    parts = [p for p in parts if p.gdn is not None]
    if not parts or parts[0].gdn.out_proj.weight.dtype != torch.bfloat16:
        return None
    lib, why = native.library()
    if lib is None:
        return why
    steps = [native.GdnStep(lib, p.gdn, p.taps, p.neg_a, p.dt_bias) for p in parts]
    for rows in (1, 3):
        if why := _native_mismatch(parts[0], steps[0], rows):
            return why
    registry = seam.patches(model)
    for p, step in zip(parts, steps):
        registry.set("native_gdn_step", p, "native", step)
    return ""


def _native_mismatch(p: Parts, step, rows: int) -> str | None:
    """The C step against `gdn_between_products` on inputs of the layer's shapes (the in-projection's parts as
    views of one product, as served; every third row's gate decays strongly)."""
    key_dim, value_dim, hk, dk, hv, dv = p.dims
    channels = 2 * key_dim + value_dim
    g = torch.Generator().manual_seed(rows)
    y = (torch.randn(rows, 1, channels + value_dim + 2 * hv, generator=g) * 2).to(torch.bfloat16)
    y[::3, :, -hv:] += 30  # softplus above its threshold: g ~ -30 * exp(A_log)
    parts = torch.split(y, [channels, value_dim, hv, hv], dim=-1)
    conv_state = torch.randn(rows, channels, step.kernel, generator=g).to(torch.bfloat16)
    state = torch.randn(rows, hv, dk, dv, generator=g) * 0.3
    conv_a, conv_b, state_a, state_b = conv_state.clone(), conv_state.clone(), state.clone(), state.clone()
    with torch.inference_mode():
        got = step(*parts, conv_a, state_a)
        if got is None:
            return "it refused the layer's own shapes"
        want, new = gdn_between_products(p, *parts, conv_b, state_b)
    if not torch.equal(conv_a, conv_b):
        return "its conv state differs"
    return verify.mismatch(got, want, torch.bfloat16) or verify.mismatch(state_a, new, torch.float32)


FUSED = "native_decode_layer"  # the kernel report's name of `install_fused`'s C layers


def install_fused(model) -> str | None:
    """Give each lean layer whose products all run `a8_products.c` (w8a8 / w4a8) its MLP block in C
    (`native.MlpBlock`), and each Gated DeltaNet layer among them the whole layer in C (`native.GdnLayer`), once
    they give the Python path's results on probes of a layer of each kind (1 and 3 rows). Call after the
    quantized products and their stacks are in place. Returns "" when on, why not when not, None when there is
    nothing it is written for."""
    layers = [(m, m.__dict__[PARTS]) for m in model.modules() if PARTS in m.__dict__]
    made = {}
    for layer, p in layers:
        if (mlp := _mlp_block(layer, p)) is not None:
            made[p] = (_gdn_layer(layer, p, mlp) if p.gdn is not None else None, mlp)
    if not made:
        return None
    checked = set()
    for p, (gdn, mlp) in made.items():
        kind = gdn is not None
        if kind in checked:
            continue
        checked.add(kind)
        for rows in (1, 3):
            if why := (_gdn_mismatch(p, gdn, rows) if gdn is not None else _mlp_mismatch(p, mlp, rows)):
                return why
    registry = seam.patches(model)
    for p, (gdn, mlp) in made.items():
        registry.set(FUSED, p, "mlp_native", mlp)
        if gdn is not None:
            registry.set(FUSED, p, "fused", gdn)
    return ""


def _mlp_block(layer, p: Parts):
    """The layer's MLP block in C, where its norm has a C form and its products are int8-activation C ones."""
    lib, _ = native.library()
    post_norm = layer.post_attention_layernorm.__dict__.get(norm.NATIVE)
    if lib is None or p.mlp is None or not p.silu or post_norm is None:
        return None
    stack, _, _ = p.mlp
    gate_up, down = stack.c_product(), Stack([layer.mlp.down_proj]).c_product()
    if gate_up is None or down is None or gate_up[0].address != down[0].address:
        return None
    (gate, up), product = gate_up[1], gate_up[0]
    if gate[1] - gate[0] != down[0].k or up[1] - up[0] != down[0].k:
        return None
    return native.MlpBlock(lib, post_norm, product, down[0], gate[0], up[0])


def _gdn_layer(layer, p: Parts, mlp: native.MlpBlock):
    """The Gated DeltaNet layer in C, where its C step is on and its norm and products have C forms (the same
    product function as its MLP block's)."""
    in_norm = layer.input_layernorm.__dict__.get(norm.NATIVE)
    in_proj, out_proj = p.in_proj.c_product(), Stack([p.gdn.out_proj]).c_product()
    if p.native is None or in_norm is None or in_proj is None or out_proj is None:
        return None
    if in_proj[0].address != mlp.args.linear or out_proj[0].address != mlp.args.linear:
        return None
    key_dim, value_dim, _, _, hv, _ = p.dims
    widths = (2 * key_dim + value_dim, value_dim, hv, hv)
    if any(b - a != w for (a, b), w in zip(in_proj[1], widths)) or out_proj[0].k != value_dim:
        return None
    at = tuple(a for a, _ in in_proj[1])
    return native.GdnLayer(mlp.lib, in_norm, in_proj[0], at, p.native, out_proj[0], mlp)


def _python_mlp(p: Parts, h):
    stack, act, down = p.mlp
    x = p.norm_post(h)
    gate, up = stack(x)
    return h + down(act(gate) * up)


def _probe_rows(rows: int, width: int, seed: int) -> torch.Tensor:
    """Hidden states small enough that the residual sum keeps the layer's change to them (the norms scale every
    input alike)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, 1, width, generator=g) * 0.01).to(torch.bfloat16)


def _change_mismatch(got: torch.Tensor, want: torch.Tensor, h: torch.Tensor) -> str | None:
    """The C layer's change to the hidden states `h` against the Python path's, as fractions of the latter's largest
    (a change compared inside the states it is added to would pass however wrong)."""
    a, b = got.float() - h.float(), want.float() - h.float()
    scale = b.abs().max().clamp_min(1e-30)
    return verify.mismatch(a / scale, b / scale, torch.bfloat16)


def _mlp_mismatch(p: Parts, mlp, rows: int) -> str | None:
    h = _probe_rows(rows, mlp.hidden, rows)
    with torch.inference_mode():
        got = mlp(h)
        if got is None:
            return "it refused the layer's own shapes"
        return _change_mismatch(got, _python_mlp(p, h), h)


def _gdn_mismatch(p: Parts, fused, rows: int) -> str | None:
    """The C layer against the Python path (`_lean`'s operations) on inputs of the layer's shapes."""
    step = p.native
    hk, dk, hv, dv = step.dims
    h = _probe_rows(rows, fused.mlp.hidden, rows)
    g = torch.Generator().manual_seed(rows)
    conv_state = torch.randn(rows, step.channels, step.kernel, generator=g).to(torch.bfloat16)
    state = torch.randn(rows, hv, dk, dv, generator=g) * 0.3
    conv_a, conv_b, state_a, state_b = conv_state.clone(), conv_state.clone(), state.clone(), state.clone()
    with torch.inference_mode():
        got = fused(h, conv_a, state_a)
        if got is None:
            return "it refused the layer's own shapes"
        mixed, z, b, a = p.in_proj(p.norm_in(h))
        out = step(mixed, z, b, a, conv_b, state_b)
        want = _python_mlp(p, h + p.out_proj(out))
    if not torch.equal(conv_a, conv_b):
        return "its conv state differs"
    return _change_mismatch(got, want, h) or verify.mismatch(state_a, state_b, torch.float32)


def uninstall(model) -> None:
    seam.revert(model, FUSED)
    seam.revert(model, "native_gdn_step")
    seam.revert(model, "decode_layer")

"""Quantization applied at load (`--quantization int8|int4|w8a8|w4a8`): the weights held once, quantized.

What is quantized, as llama.cpp's Q8_0 and Q4_0 files have it (`layout`: GGUF's Q8_0 / Q4_0 blocks, 32 weights
and one float16 scale each):
- every `nn.Linear` of the decoder (attention, Gated DeltaNet and Mamba2 projections, MLPs, shared experts):
  Q8_0 for int8, Q4_0 for int4;
- the routed experts of MoE blocks (transformers' fused 3-D expert weights), at the body's format, each
  expert's slice as a linear layer's weight (`experts.QuantExperts`);
- the output head at 6 bits or more (`formats.HEADS`): its errors land on every logit, so llama.cpp never puts
  it below the body's bits (Q8_0 in a Q8_0 file, Q6_K in Q4_0 and Q4_K_M files). Q8_0 for int8 and w8a8; w4a8's
  at Q6_0 (`layout`), as fine as Q6_K and a quarter fewer bytes than Q8_0 for the one product that reads a
  248k-row head every step; int4's at Q8_0 (the weight-only products take no 6-bit weights);
- the token embedding at the body's format (llama.cpp's `token_embd` is Q8_0 in Q8_0 files, Q4_0 in Q4_0
  files): a lookup dequantizes only the rows it reads, so it costs no time. A head tied to the embedding is
  one tensor, quantized as the head (as llama.cpp quantizes `token_embd` when there is no `output`).

What stays in the model's dtype, with one start-up line saying so:
- MoE routers (`gate`, `shared_expert_gate`, `router`): llama.cpp keeps `ffn_gate_inp` unquantized, since a
  rounding there changes which experts run;
- a layer whose input width is not a multiple of 32 (no whole Q8_0 blocks), and routed experts of another
  layout than transformers' eager one (transposed, with biases or a gating of their own).
Norms, convolutions and the recurrent layers' small parameters stay as they are (llama.cpp keeps them F32).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from ..logs import human_bytes
from . import checkpoint, ggml_blocks, loading  # noqa: F401  (quant.checkpoint.refusal, quant.loading.load)
from .experts import QuantExperts, fits_blocks, fused_weights, quantized_linears
from .formats import FORMATS, HEADS, INT8_ACTIVATIONS, ROUTERS, SCHEMES, WEIGHT_ONLY, WEIGHTS  # noqa: F401
from .ggml_blocks import GgmlEmbedding, GgmlLinear  # noqa: F401  (re-exported: the runtime and env look for it)
from .layout import BLOCK, QuantEmbedding, QuantLinear, format_of, quantize

log = logging.getLogger("hyserve.quant")


@dataclass
class Quantized:
    """What `apply` did to a model: for the start-up log, `hyserve env` and the tests."""

    scheme: str
    layers: int = 0  # linear layers and embeddings now held as int8
    bytes_before: int = 0  # of the weights quantized, in the model's dtype
    bytes_after: int = 0  # of their int8 values and scales
    kept: dict[str, str] = field(default_factory=dict)  # a weight left in the model's dtype -> why
    head: str | None = None  # the head's blocks as held ("q6_0", ...; a GGUF file's own where it kept them)

    def describe(self) -> str:
        body, head = FORMATS[WEIGHTS[self.scheme]].upper(), (self.head or FORMATS[HEADS[self.scheme]]).upper()
        blocks = body if head == body else f"{body}, the head {head}"
        if self.scheme in INT8_ACTIVATIONS:
            blocks += "; each product's input rounded to Q8_0 blocks"
        line = (
            f"{self.scheme} ({blocks}, blocks of {BLOCK}): {self.layers} layers, "
            f"{human_bytes(self.bytes_before)} -> {human_bytes(self.bytes_after)}"
        )
        if self.kept:
            reasons: dict[str, list[str]] = {}
            for name, why in self.kept.items():
                reasons.setdefault(why, []).append(name)
            line += "; left unquantized: " + "; ".join(
                f"{len(names)} {why} ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})"
                for why, names in reasons.items()
            )
        return line


def _nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def apply(model, scheme: str, held: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None) -> Quantized:
    """Replace `model`'s linear layers and embedding by int8 ones (see the module docstring), in place, so that
    no float copy of their weights stays referenced. Raises ValueError for a scheme or device it cannot serve.
    `held`: blocks already made as the weights were loaded (`loading`), by the id of the placeholder the model
    holds in each weight's place; a placeholder left unreplaced, or blocks not of the format chosen here, raise
    RuntimeError."""
    if scheme not in SCHEMES:
        raise ValueError(f"quantization must be one of {', '.join(SCHEMES)} (got {scheme!r})")
    device = next(model.parameters()).device
    if device.type != "cpu":
        raise ValueError(f"--quantization {scheme} runs on CPU only (the model is on {device.type})")
    done = Quantized(scheme)
    head_format = HEADS[scheme]
    scheme = WEIGHTS[scheme]  # the weights' format; the activations' rounding is set on the layers at the end
    # ids, not references: a float weight is freed as soon as its module is replaced (peak: float + one layer)
    embedding_id = id(model.get_input_embeddings())
    head_weight_id = id(getattr(model.get_output_embeddings(), "weight", None))
    made: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(weight) -> (qs, d): a tied weight quantized once

    held = held or {}

    def blocks(weight: torch.Tensor, scheme: str) -> tuple[torch.Tensor, torch.Tensor]:
        if id(weight) not in held:
            return quantize(weight, scheme)
        made_at_load = held[id(weight)]
        if format_of(*made_at_load) != FORMATS[scheme]:
            raise RuntimeError(f"a weight was quantized at load in another format than {scheme}'s")
        return made_at_load

    def q(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if id(weight) not in made:
            made[id(weight)] = blocks(weight, head_format if id(weight) == head_weight_id else scheme)
            done.bytes_before += _nbytes(weight)
            done.bytes_after += _nbytes(*made[id(weight)])
        return made[id(weight)]

    def replace(parent: torch.nn.Module, prefix: str) -> None:
        for name in [name for name, _ in parent.named_children()]:
            replace_child(parent, name, f"{prefix}{name}")

    def replace_child(parent: torch.nn.Module, name: str, full: str) -> None:
        child = getattr(parent, name)
        if type(child) is torch.nn.Linear:
            if name in ROUTERS:
                done.kept[full] = "MoE router(s), kept as llama.cpp keeps them"
            elif child.in_features % BLOCK:
                done.kept[full] = f"layer(s) whose input width is not a multiple of {BLOCK}"
            else:
                setattr(parent, name, QuantLinear(*q(child.weight), child.bias, child.weight.dtype))
                done.layers += 1
        elif fused_weights(child) is not None and fits_blocks(child):
            done.bytes_before += _nbytes(*(getattr(child, n) for n in fused_weights(child)))
            up, down = (getattr(child, n) for n in fused_weights(child))
            if id(up) in held or id(down) in held:
                experts = QuantExperts.from_blocks(child, blocks(up, scheme), blocks(down, scheme))
            else:
                experts = QuantExperts(child, scheme)
            setattr(parent, name, experts)
            done.layers += 2
            done.bytes_after += _nbytes(experts.up_qs, experts.up_d, experts.down_qs, experts.down_d)
        elif type(child) is torch.nn.Embedding and id(child) == embedding_id:
            if child.embedding_dim % BLOCK:
                done.kept[full] = f"embedding(s) whose width is not a multiple of {BLOCK}"
            else:
                setattr(parent, name, QuantEmbedding(*q(child.weight), child.weight.dtype))
                done.layers += 1
        else:
            replace(child, full + ".")

    head = model.get_output_embeddings()
    if type(head) is torch.nn.Linear and head.weight is getattr(model.get_input_embeddings(), "weight", None):
        # a tied head first, so that its float weight goes with the embedding's, not after every layer
        head_name = next(n for n, m in model.named_modules() if m is head)
        parent_name, _, attr = head_name.rpartition(".")
        del head
        replace_child(model.get_submodule(parent_name), attr, head_name)
    else:
        del head
    replace(model, "")
    made.clear()
    if held and (left := [n for n, t in model.named_parameters(remove_duplicate=False) if id(t) in held]):
        raise RuntimeError(f"weights quantized at load but not replaced: {', '.join(left[:3])}")
    if isinstance(head := model.get_output_embeddings(), QuantLinear):
        done.head = format_of(head.qs, head.d)
    if done.scheme in INT8_ACTIVATIONS:
        for layer in quantized_linears(model):
            layer.rounds_activations = True
    for module_name, module in model.named_modules():
        if not isinstance(module, torch.nn.modules.conv._ConvNd):  # a conv's weight is 3-D too
            for name, p in module.named_parameters(recurse=False):
                if p.dim() == 3:
                    done.kept[f"{module_name}.{name}"] = "routed expert weight(s) of another layout or width"
    return done


def round_activations_of_kept(model) -> None:
    """A GGUF file's Q8_0 / Q4_0 blocks kept as they are (`QuantLinear`s, experts' too) multiplied as w8a8 / w4a8
    multiply: their inputs rounded to Q8_0 blocks, the int8-activation C products and decode layers (the other
    types' `GgmlLinear`s round theirs already)."""
    for layer in quantized_linears(model):
        layer.rounds_activations = True


def runs_all_experts(model) -> bool:
    """Whether every MoE experts module of `model` is a `QuantExperts` (then transformers' experts
    implementations run nowhere, and choosing one is moot)."""
    held = [m for m in model.modules() if isinstance(m, QuantExperts)]
    return bool(held) and not any(fused_weights(m) is not None for m in model.modules())


def install_products(model, dtype: torch.dtype) -> dict[str, str]:
    """The C products for a decode step's few rows over the quantized weights (`native.install`; a GGUF file's
    blocks of other types: `ggml_native.install`), then the decode
    layers in C over them (`kernels.decode_layer.install_fused`): per kernel name, "" or why off."""
    from ..kernels import decode_layer
    from . import ggml_native, native, siblings

    decided = native.install(model, dtype)
    decided.update(ggml_native.install(model, dtype))  # a GGUF file's other types, held as its blocks
    if stacks := siblings.group(model):
        log.info("quantized sibling projections stacked: %d groups, one product each", stacks)
    if (why := decode_layer.install_fused(model)) is not None:
        decided[decode_layer.FUSED] = why
    return decided

"""hyserve's own GGUF loader, for the architectures a module of `families` covers: the HF config and model
built from the file's metadata, each tensor turned back into the HF one by its family module, and quantized
weights kept as the file's blocks where the family's transform only moves whole rows and blocks: Q8_0 / Q4_0 ones
of a linear layer or the embedding as `quant.layout.QuantLinear` / `QuantEmbedding`, a MoE block's stacked experts
as `quant.experts.QuantExperts` (on CPU, where both its weights are kept); Q4_1, Q5_0, Q5_1, Q4_K, Q5_K and Q6_K
ones of a linear layer or the embedding, on CPU, as `quant.ggml_blocks.GgmlLinear` / `GgmlEmbedding`. Every other
tensor (F32, F16, other types, stacked experts of those types) is dequantized by gguf to the model's dtype.

The model is served as if from its HF folder: the tokenizer and chat template come from the metadata through
transformers' GGUF tokenizer conversion.
"""

from __future__ import annotations

import mmap
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..quant.experts import QuantExperts, fused_weights
from . import architectures, blocks
from .architectures import Part
from .file import GGUFError, readers

_SKIP_META = ("GGUF.",)


@dataclass
class Loaded:
    """What the load did with the file's tensors: for the start-up log and `hyserve env`."""

    dtype: torch.dtype
    kept: Counter = field(default_factory=Counter)  # ggml type -> HF weights held as the file's blocks
    experts: Counter = field(default_factory=Counter)  # ggml type -> of those, stacked expert weights
    converted: Counter = field(default_factory=Counter)  # ggml type -> GGUF tensors dequantized
    why: dict[str, str] = field(default_factory=dict)  # a quantized tensor (or HF weight) dequantized -> why

    def describe(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        kept = ", ".join(f"{n} {t}" for t, n in self.kept.most_common())
        converted = ", ".join(f"{n} {t}" for t, n in self.converted.most_common())
        parts = [f"{kept} kept quantized as the file's blocks" if kept else "none kept quantized"]
        if experts := sum(self.experts.values()):
            parts[0] += f" ({experts} of them stacked expert weights, in quant.experts)"
        if converted:
            parts.append(f"{converted} dequantized to {dtype}")
        line = "; ".join(parts)
        if self.why:
            reasons = Counter(self.why.values())
            line += " (the quantized ones: " + "; ".join(f"{n} {why}" for why, n in reasons.items()) + ")"
        return line


def metadata(r) -> dict:
    """key -> python value of every metadata field (not the GGUF header's own)."""
    return {key: f.contents() for key, f in r.fields.items() if not key.startswith(_SKIP_META)}  # split.* too


def file_metadata(parts) -> dict:
    """What a family's `config` reads: the metadata, and under "tensor_shapes" every tensor's shape (numpy order),
    since some of a config is only in which tensors there are (an optional norm or bias, the embedding's rows), and
    under "rope_freqs" the values of that tensor where there is one (Llama 3's rope scaling: config, not weight)."""
    meta = metadata(parts[0])
    meta["tensor_shapes"] = {t.name: tuple(int(n) for n in reversed(t.shape)) for r in parts for t in r.tensors}
    for t in (t for r in parts for t in r.tensors if t.name == "rope_freqs.weight"):
        from gguf.quants import dequantize

        meta["rope_freqs"] = np.asarray(dequantize(np.asarray(t.data), t.tensor_type), dtype=np.float32)
    return meta


def build_config(names: set[str], meta: dict):
    """The HF config of a file with these tensor names and this metadata."""
    from transformers import AutoConfig

    arch = meta["general.architecture"]
    cfg = architectures.module_for(arch).config(meta)
    cfg["tie_word_embeddings"] = "output.weight" not in names
    model_type = cfg.pop("model_type")
    return AutoConfig.for_model(model_type, **cfg), cfg


def load(path: Path, dtype: torch.dtype, device: str):
    """(model, tokenizer, Loaded) from a checked GGUF file of a `families` architecture."""
    from accelerate import init_empty_weights
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize
    from transformers import AutoModelForCausalLM

    parts = readers(path)
    meta = file_metadata(parts)
    family = architectures.module_for(meta["general.architecture"])
    config, cfg = build_config({t.name for r in parts for t in r.tensors}, meta)
    cfg["model_type"] = config.model_type
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    # buffers the model makes in float32 whatever its dtype (LFM2-MoE's expert_bias, Nemotron-H's router
    # correction bias), as loading its folder keeps them
    dtypes = {name: b.dtype for name, b in model.named_buffers() if b.dtype.is_floating_point}
    modules = dict(model.named_modules())
    done = Loaded(dtype)
    pieces: dict[str, list[tuple[Part | None, object]]] = {}  # HF name -> (where, Blocks or float tensor)

    for part_reader, t in ((p, t) for p in parts for t in p.tensors):
        kind = t.tensor_type.name
        raw = np.asarray(t.data)
        try:
            entries = None
            if kind in blocks.KEPT or (kind in blocks.RAW and device == "cpu"):
                entries = _kept(family, t.name, kind, raw, meta, cfg)
                if entries is None:
                    done.why[t.name] = "whose conversion moves weights within blocks or changes them"
            if entries is None:
                array = raw if t.tensor_type in (GGMLQuantizationType.F32,) else dequantize(raw, t.tensor_type)
                entries = family.tensors(t.name, array, meta, cfg)
                done.converted[kind] += 1
        except KeyError as exc:
            raise GGUFError(
                f"{path.name}: tensor {t.name} ({kind}) has no place in a {config.model_type} model "
                f"(a newer or other converter's layout?)"
            ) from exc
        if not any(isinstance(v[1] if isinstance(v, tuple) else v, blocks.RawBlocks) for _, v in entries):
            _release(part_reader, t)  # copied or converted: its pages of the file are not needed again
        for hf, value in entries:
            if hf not in shapes:
                raise GGUFError(
                    f"{path.name}: tensor {t.name} became {hf}, which a {config.model_type} model does not have"
                )
            if isinstance(value, Part):
                value = (value, value.data)
            if not isinstance(value, tuple):
                value = (None, value)
            if value[0] is None and tuple(value[1].shape) != shapes[hf]:
                got = tuple(value[1].shape)
                raise GGUFError(
                    f"{path.name}: tensor {t.name} has shape {got} as {hf}, where the config from the "
                    f"file's metadata makes {shapes[hf]}"
                )
            if value[0] is None and isinstance(value[1], torch.Tensor):
                value = (None, value[1].to(dtypes.get(hf, dtype)))  # now: no float32 copy of the whole model
            pieces.setdefault(hf, []).append(value)

    state: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[str, blocks.Blocks]] = {}  # experts module -> its weights kept as blocks, by name
    for hf, its_pieces in pieces.items():
        value = _assemble(hf, its_pieces, shapes[hf], modules, done, device)
        if isinstance(value, blocks.RawBlocks) and len(value.shape) == 3:
            done.why[hf] = f"of stacked experts in {value.kind} (quant.experts holds Q8_0 / Q4_0 only)"
            done.converted.update([value.kind] * len(its_pieces))
            state[hf] = _float(value).to(dtype)
        elif isinstance(value, blocks.RawBlocks):
            _install(model, modules, hf, value, dtype)
            done.kept[value.kind] += 1
        elif isinstance(value, blocks.Blocks) and len(value.shape) == 3:
            owner, _, attr = hf.rpartition(".")
            experts.setdefault(owner, {})[attr] = value
        elif isinstance(value, blocks.Blocks):
            _install(model, modules, hf, value, dtype)
            done.kept[value.kind] += 1
        else:
            state[hf] = value.to(dtypes.get(hf, dtype))
    for owner, held in experts.items():
        names = fused_weights(modules[owner])
        if all(name in held for name in names):
            _install_experts(modules, owner, held[names[0]], held[names[1]])
            done.kept.update(b.kind for b in held.values())
            done.experts.update(b.kind for b in held.values())
            continue
        for attr, b in held.items():  # the other weight is of another type: both float
            hf = f"{owner}.{attr}"
            done.why[hf] = "of stacked experts whose other weight is not Q8_0/Q4_0"
            done.converted.update([b.kind] * len(pieces[hf]))
            state[hf] = _float(b).to(dtype)
    model.load_state_dict(state, strict=False, assign=True)
    if config.tie_word_embeddings:
        _tie(model)
    absent = [n for n, p in [*model.named_parameters(), *model.named_buffers()] if p.device.type == "meta"]
    if absent:
        raise GGUFError(
            f"{path.name} has no tensor for {len(absent)} weight(s) of the model: "
            f"{', '.join(absent[:4])}{', ...' if len(absent) > 4 else ''}"
        )
    return model.to(device).eval(), tokenizer(path), done


def _release(reader, t) -> None:
    """Drop tensor `t`'s pages of the mapped file from this process: a weight copied out of the file (Q8_0 / Q4_0
    values split from their scales) or converted no longer needs them, and the load's peak memory would otherwise
    hold the file and its copies at once. The mapping is private and never written, so a page dropped is read
    from the file again if anything touches it (a neighbour's view sharing a page)."""
    mm = getattr(reader.data, "_mmap", None)
    if mm is None or not hasattr(mm, "madvise"):
        return
    start = int(t.data_offset) // mmap.PAGESIZE * mmap.PAGESIZE
    try:
        mm.madvise(mmap.MADV_DONTNEED, start, int(t.data_offset) + int(t.n_bytes) - start)
    except (OSError, ValueError):
        pass


def _kept(family, name: str, kind: str, raw: np.ndarray, meta: dict, cfg: dict):
    """The entries of a quantized weight (2-D, or 3-D stacked experts) as the file's blocks (`Blocks` for Q8_0 /
    Q4_0, else `RawBlocks`), or None where its transform changes values or moves weights within blocks."""
    source = blocks.split(kind, raw) if kind in blocks.KEPT else blocks.split_raw(kind, raw)
    block = getattr(source, "block", blocks.BLOCK)
    if source.rows().shape[0] >= blocks.EXACT or source.shape[-1] >= blocks.EXACT or len(source.shape) > 3:
        return None
    row_probe, col_probe = blocks.probes(source.shape)
    by_rows = family.tensors(name, row_probe, meta, cfg)
    by_cols = family.tensors(name, col_probe, meta, cfg)
    entries = []
    for (hf, rows_out), (_, cols_out) in zip(by_rows, by_cols):
        part = rows_out if isinstance(rows_out, Part) else None
        rows_out, cols_out = (part.data, cols_out.data) if part else (rows_out, cols_out)
        if part is not None and part.dim >= rows_out.dim() - 1:  # slices along the columns: not whole rows
            return None
        found = blocks.moved(rows_out, cols_out, source.shape, block)
        if found is None and isinstance(source, blocks.RawBlocks) and part is None and rows_out.dim() == 2:
            # whole rows, columns reordered within blocks (Qwen3.5's value heads in `ssm_out`, narrower than a
            # K-quant block): the file's rows, and the input put in the file's column order at each product
            found = blocks.columns_reordered(rows_out, cols_out, source.shape)
            if found is not None:
                rows, order = found
                out = source.select(rows, torch.arange(source.k // block))
                out.input_order = order
                entries.append((hf, (None, out)))
                continue
        if found is None:
            return None
        out = source.select(*found, lead=tuple(rows_out.shape[:-2]))
        entries.append((hf, (part, out)))
    return entries


def _not_held(hf: str, shape: tuple, modules: dict, device: str) -> str | None:
    """Why HF weight `hf` cannot be held as blocks, or None: a linear layer's or the embedding's 2-D weight can,
    and a 3-D weight of an experts module `QuantExperts` holds (it runs on CPU)."""
    owner_name, _, attr = hf.rpartition(".")
    owner = modules.get(owner_name)
    if len(shape) == 2 and hf.endswith(".weight") and isinstance(owner, (torch.nn.Linear, torch.nn.Embedding)):
        return None
    if len(shape) != 3 or attr not in (fused_weights(owner) or ()):  # (up or gate-up, down) QuantExperts holds
        return "of a weight not held by a linear layer"
    if device != "cpu":
        return f"of stacked experts on {device} (quant.experts runs on CPU)"
    return None


def _assemble(hf: str, parts: list, shape: tuple, modules: dict, done: Loaded, device: str):
    """One HF tensor from its pieces: Blocks where every piece is of one kept type and the weight can be held
    so (`_not_held`), else a float tensor."""
    held = (blocks.Blocks, blocks.RawBlocks)
    kinds = {v.kind for _, v in parts if isinstance(v, held)}
    why = _not_held(hf, shape, modules, device) if kinds else None
    if kinds and why is None and (len(kinds) > 1 or any(not isinstance(v, held) for _, v in parts)):
        why = "of a weight whose pieces differ in type"
    if why is not None:
        done.why[hf] = why
        done.converted.update(v.kind for _, v in parts if isinstance(v, held))
    elif kinds:
        if len(parts) == 1 and parts[0][0] is None:
            return parts[0][1]
        first = parts[0][1]
        if isinstance(first, blocks.RawBlocks):
            raw = torch.empty((*shape[:-1], first.raw.shape[-1]), dtype=torch.uint8)
            covered = torch.zeros(shape[parts[0][0].dim], dtype=torch.bool)
            for part, v in parts:
                raw.index_copy_(part.dim, part.index, v.raw)
                covered[part.index] = True
            _check_covered(hf, covered)
            return blocks.RawBlocks(first.kind, raw, shape[-1])
        qs = torch.empty((*shape[:-1], first.qs.shape[-1]), dtype=first.qs.dtype)
        d = torch.empty((*shape[:-1], first.d.shape[-1]), dtype=torch.float16)
        covered = torch.zeros(shape[parts[0][0].dim], dtype=torch.bool)
        for part, v in parts:  # in the file's order, whichever it is (gate then up, or up then gate)
            qs.index_copy_(part.dim, part.index, v.qs)
            d.index_copy_(part.dim, part.index, v.d)
            covered[part.index] = True
        _check_covered(hf, covered)
        return blocks.Blocks(kinds.pop(), qs, d)
    floats = [(part, _float(v)) for part, v in parts]
    if len(floats) == 1 and floats[0][0] is None:
        return floats[0][1].reshape(shape)
    full = torch.empty(shape, dtype=torch.float32)
    covered = torch.zeros(shape[floats[0][0].dim], dtype=torch.bool)
    for part, v in floats:
        full.index_copy_(part.dim, part.index, v.float())
        covered[part.index] = True
    _check_covered(hf, covered)
    return full


def _float(v) -> torch.Tensor:
    if isinstance(v, blocks.RawBlocks):
        from ..quant import ggml_blocks

        flat = v.rows()
        return ggml_blocks.dequantize(flat.raw.contiguous(), v.kind, v.k).reshape(v.shape)
    if isinstance(v, blocks.Blocks):
        from ..quant.layout import dequantize

        flat = v.rows()
        return dequantize(flat.qs, flat.d, torch.float32).reshape(v.shape)
    return v


def _check_covered(hf: str, covered: torch.Tensor) -> None:
    if not bool(covered.all()):
        raise GGUFError(f"the file's tensors fill only {int(covered.sum())} of the {covered.numel()} slices of {hf}")


def _install(model, modules: dict, hf: str, b: blocks.Blocks | blocks.RawBlocks, dtype: torch.dtype) -> None:
    from ..quant.ggml_blocks import GgmlEmbedding, GgmlLinear
    from ..quant.layout import QuantEmbedding, QuantLinear

    parent_name, _, attr = hf.removesuffix(".weight").rpartition(".")
    owner = modules[hf.removesuffix(".weight")]
    parent = modules[parent_name]
    if isinstance(b, blocks.RawBlocks) and isinstance(owner, torch.nn.Embedding):
        setattr(parent, attr, GgmlEmbedding(b.raw.contiguous(), b.kind, b.k, dtype))
    elif isinstance(b, blocks.RawBlocks):
        setattr(parent, attr, GgmlLinear(b.raw.contiguous(), b.kind, b.k, owner.bias, dtype, b.input_order))
    elif isinstance(owner, torch.nn.Embedding):
        setattr(parent, attr, QuantEmbedding(b.qs, b.d, dtype))
    else:  # a bias (still on the meta device) is filled from the state dict
        setattr(parent, attr, QuantLinear(b.qs, b.d, owner.bias, dtype))


def _install_experts(modules: dict, name: str, up: blocks.Blocks, down: blocks.Blocks) -> None:
    """The experts module `name` replaced by a `QuantExperts` over the file's blocks of its two weights."""
    parent_name, _, attr = name.rpartition(".")
    held = QuantExperts.from_blocks(modules[name], (up.qs, up.d), (down.qs, down.d))
    setattr(modules[parent_name], attr, held)


def _tie(model) -> None:
    """The head tied to the embedding, as transformers ties it; a kept-quantized embedding is shared as blocks
    (one tensor, as `quant.apply` does)."""
    from ..quant.ggml_blocks import GgmlEmbedding, GgmlLinear
    from ..quant.layout import QuantEmbedding, QuantLinear

    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    if isinstance(embedding, GgmlEmbedding):
        e = embedding
        model.set_output_embeddings(GgmlLinear(e.blocks, e.kind, e.embedding_dim, None, e.dtype))
    elif isinstance(embedding, QuantEmbedding):
        model.set_output_embeddings(QuantLinear(embedding.qs, embedding.d, None, embedding.dtype))
    else:
        head.weight = embedding.weight


def tokenizer(path: Path):
    """The tokenizer and chat template from the file's metadata (transformers' GGUF tokenizer conversion)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)

"""Load a Hugging Face folder under `--quantization`, each weight quantized as transformers loads it, so that the
float model never exists whole (loading it all and then quantizing held the float model, the quantized one and
the checkpoint's mapped pages at once).

Through transformers' own loading (its key renames, its converters that fuse per-expert weights), with an
`HfQuantizer` of hyserve's, as bitsandbytes and torchao quantize while loading: with one, transformers reads one
tensor at a time, casts it to the model's dtype and hands the weights `apply` would quantize to `Quantize`. That
keeps the weight's blocks (`layout.quantize` of the weight as loaded: what `apply` makes of it after a plain load)
and gives transformers a placeholder of the weight's shape over a single element; `apply` then builds the
quantized modules from those blocks, checking each is of the format it would choose. So at most one weight (a
MoE block's fused experts) is in float at a time.

A safetensors checkpoint is read through its memory mapping, as transformers reads it; each tensor's pages are
dropped from the process once the tensor read is gone (`mapped_pages`), so that the mapped checkpoint does not
stay resident to the end of the load either.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch

from . import mapped_pages
from .experts import fits_blocks, fused_weights, quantize_3d
from .formats import HEADS, ROUTERS, WEIGHTS
from .layout import BLOCK, quantize

METHOD = "hyserve"  # the quant_method under which transformers finds `OnLoad`


def format_for(model, name: str, scheme: str) -> str | None:
    """The weight format (`formats.WEIGHTS`, `formats.HEADS`) `apply` quantizes the parameter `name` of `model` (on
    the meta device) at under `scheme`, or None for one it keeps in float: `apply` checks the blocks made here
    against its own choice."""
    module_name, _, attr = name.rpartition(".")
    module = model.get_submodule(module_name) if module_name else model
    if type(module) is torch.nn.Linear and attr == "weight":
        if module_name.rpartition(".")[2] in ROUTERS or module.in_features % BLOCK:
            return None
        return HEADS[scheme] if module is model.get_output_embeddings() else WEIGHTS[scheme]
    if type(module) is torch.nn.Embedding and attr == "weight" and module is model.get_input_embeddings():
        if module.embedding_dim % BLOCK:
            return None
        return HEADS[scheme] if _tied_head(model, module) else WEIGHTS[scheme]
    if attr in (fused_weights(module) or ()) and fits_blocks(module):
        return WEIGHTS[scheme]
    return None


def _tied_head(model, embedding) -> bool:
    """Whether the output head is `embedding`'s weight. On the meta device, while loading, transformers has not
    tied them yet (it does at the end): its own map of the weights it will tie says."""
    head = model.get_output_embeddings()
    if head is None:
        return False
    if getattr(head, "weight", None) is embedding.weight:
        return True
    names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    tied = model.get_expanded_tied_weights_keys(all_submodels=True)  # target -> source
    return tied.get(f"{names[id(head)]}.weight") == f"{names[id(embedding)]}.weight"


def placeholder(like: torch.Tensor) -> torch.Tensor:
    """A tensor of `like`'s shape and dtype over one element: what the model holds in a quantized weight's place
    until `apply` replaces its module."""
    return torch.zeros((), dtype=like.dtype).expand(like.shape)


def _quantized(weight: torch.Tensor, scheme: str) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_3d(weight, scheme) if weight.dim() == 3 else quantize(weight, scheme)  # 3-D: fused experts


@functools.cache
def _settings_class():
    """`OnLoadConfig`, with `OnLoad` registered under `METHOD` (transformers' classes are imported only when a
    quantized load runs)."""
    from transformers.core_model_loading import ConversionOps
    from transformers.quantizers import HfQuantizer
    from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING, AUTO_QUANTIZER_MAPPING
    from transformers.utils.quantization_config import QuantizationConfigMixin

    class OnLoadConfig(QuantizationConfigMixin):
        """The scheme, and what the load made: `held` (placeholder's id -> its blocks), the placeholders kept
        alive with it (so that an id names one placeholder alone, even one transformers let go)."""

        def __init__(self, scheme: str):
            self.quant_method = METHOD
            self.scheme = scheme
            self.held: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
            self.placeholders: list[torch.Tensor] = []

        def __deepcopy__(self, memo):  # transformers copies the config: the copy shares what the load makes
            return self

        def to_dict(self) -> dict:
            return {"quant_method": METHOD, "scheme": self.scheme}

    class Quantize(ConversionOps):
        def __init__(self, quantizer):
            self.quantizer = quantizer

        def convert(self, input_dict, model=None, **kwargs):
            config = self.quantizer.quantization_config
            out = {}
            for name, value in input_dict.items():
                weight = value[0] if isinstance(value, list) else value
                scheme = format_for(model, name, config.scheme)
                if scheme is None:
                    out[name] = value
                    continue
                blocks = _quantized(weight, scheme)
                held = torch.nn.Parameter(placeholder(weight), requires_grad=False)  # set as it is
                config.held[id(held)] = blocks
                config.placeholders.append(held)
                out[name] = held
            return out

    class OnLoad(HfQuantizer):
        requires_calibration = False
        load_dtype = None  # the dtype the load casts to (`update_dtype`)

        def param_needs_quantization(self, model, param_name: str, **kwargs) -> bool:
            scheme = format_for(model, param_name, self.quantization_config.scheme)
            # a weight the model keeps in another dtype than the load's is quantized by `apply` after the load
            return scheme is not None and model.get_parameter_or_buffer(param_name).dtype == self.load_dtype

        def update_dtype(self, dtype):
            self.load_dtype = dtype
            return dtype

        def get_quantize_ops(self):
            return Quantize(self)

        def is_serializable(self):
            return False

        @property
        def is_trainable(self):
            return False

    AUTO_QUANTIZATION_CONFIG_MAPPING.setdefault(METHOD, OnLoadConfig)
    AUTO_QUANTIZER_MAPPING.setdefault(METHOD, OnLoad)
    return OnLoadConfig


def load(model_dir: Path, dtype: torch.dtype, scheme: str):
    """(model, made): the model of `model_dir` in `dtype` with placeholders where `apply` puts quantized modules,
    and those modules' blocks (`made.held`: placeholder's id -> (values, scales)) for `apply(model, scheme,
    made.held)`; `made` keeps the placeholders alive until then."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    settings = _settings_class()(scheme)
    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    model_class = _model_class(config)
    with mapped_pages.released(safetensors_files(model_dir) if model_class else None) as state_dict:
        if state_dict is None:  # not safetensors (or no madvise): transformers reads the folder its own way
            model = AutoModelForCausalLM.from_pretrained(
                model_dir, dtype=dtype, local_files_only=True, quantization_config=settings
            )
        else:  # as `from_pretrained(model_dir)` does, over the slices that drop their pages
            try:
                generation = GenerationConfig.from_pretrained(model_dir, local_files_only=True)
            except OSError:
                generation = None
            model = model_class.from_pretrained(
                None,
                config=config,
                state_dict=state_dict,
                dtype=dtype,
                quantization_config=settings,
                generation_config=generation,
            )
            model.config.name_or_path = str(model_dir)
    model.hf_quantizer.remove_quantization_config(model)  # the model computes as a float one until `apply`
    model.config._is_quantized = False
    return model, settings


def _model_class(config):
    """The class `AutoModelForCausalLM` picks for `config`, or None (then its own load says why)."""
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.auto_factory import _get_model_class

    if type(config) not in AutoModelForCausalLM._model_mapping:
        return None
    return _get_model_class(config, AutoModelForCausalLM._model_mapping)


def safetensors_files(model_dir: Path) -> list[Path] | None:
    """The safetensors files transformers would load from `model_dir` (the index's shards, or model.safetensors),
    or None when it holds none."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        return [model_dir / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    single = model_dir / "model.safetensors"
    return [single] if single.is_file() else None

"""The family layer: one module per model family (or layer kind), and a registry from transformers'
`model_type` to the adapter that serves it. Adding a family is adding a module and a line below; the
engine, cache and batching never name a family."""

from __future__ import annotations

from .attention import AttentionAdapter
from .bamba import BambaAdapter
from .base import FamilyAdapter, RollbackPoint
from .falcon_h1 import FalconH1Adapter
from .gated_deltanet import HybridLinearAttentionAdapter
from .granite import GraniteMoeHybridAdapter
from .jamba import JambaAdapter
from .lfm2 import Lfm2Adapter
from .mamba2 import Mamba2Adapter
from .nemotron_h import NemotronHAdapter
from .zamba2 import Zamba2Adapter

ADAPTERS: tuple[type[FamilyAdapter], ...] = (
    HybridLinearAttentionAdapter,
    Mamba2Adapter,
    AttentionAdapter,
    NemotronHAdapter,
    GraniteMoeHybridAdapter,
    BambaAdapter,
    FalconH1Adapter,
    Lfm2Adapter,
    JambaAdapter,
    Zamba2Adapter,
)
REGISTRY: dict[str, type[FamilyAdapter]] = {t: cls for cls in ADAPTERS for t in cls.model_types}
SUPPORTED_MODEL_TYPES = tuple(REGISTRY)


class UnsupportedModelError(ValueError):
    pass


def adapter_for(model) -> FamilyAdapter:
    """The adapter for `model`, chosen by `config.model_type`; an unknown type names the supported ones."""
    model_type = model.config.model_type
    cls = REGISTRY.get(model_type)
    if cls is None:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    return cls(model)


__all__ = [
    "ADAPTERS",
    "REGISTRY",
    "SUPPORTED_MODEL_TYPES",
    "UnsupportedModelError",
    "adapter_for",
    "FamilyAdapter",
    "RollbackPoint",
    *(cls.__name__ for cls in ADAPTERS),
]

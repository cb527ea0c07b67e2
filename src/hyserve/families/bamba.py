"""IBM Bamba: Mamba2 layers and a few attention layers.

| cache layer                | kind  | cut back                  | snapshot / batch / rollback              |
|----------------------------|-------|---------------------------|------------------------------------------|
| linear_attention (Mamba2)  | state | only at exact checkpoints | copied whole / rows stacked / saved copy, kept tokens re-run |
| full_attention (RoPE)      | kv    | to any prefix             | copied or shared / left-padded / cut by length |

transformers' Bamba numbers a piece's tokens from 0 whatever the cache holds (its `generate` passes
positions), so every pass is given its positions: a piece after a checkpoint rotates as in one prefill.
"""  # noqa: E501 (markdown table rows, one a line)

from __future__ import annotations

from .base import FamilyAdapter


class BambaAdapter(FamilyAdapter):
    model_types = ("bamba",)
    state_layers = {"linear_attention": "state", "full_attention": "kv"}
    explicit_positions = True

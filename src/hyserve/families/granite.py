"""IBM Granite 4.0-H (micro, tiny, small): Mamba2 layers with an attention layer every few, MoE MLPs.

| cache layer                | kind  | cut back                  | snapshot / batch / rollback              |
|----------------------------|-------|---------------------------|------------------------------------------|
| linear_attention (Mamba2)  | state | only at exact checkpoints | copied whole / rows stacked / saved copy, kept tokens re-run |
| full_attention (no RoPE)   | kv    | to any prefix             | copied or shared / left-padded / cut by length |

A checkpoint inside a prefill piece is taken by splitting the prefill there.
"""  # noqa: E501 (markdown table rows, one a line)

from __future__ import annotations

from .base import FamilyAdapter


class GraniteMoeHybridAdapter(FamilyAdapter):
    model_types = ("granitemoehybrid",)
    state_layers = {"linear_attention": "state", "full_attention": "kv"}

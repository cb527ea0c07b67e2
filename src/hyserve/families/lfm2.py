"""LiquidAI LFM2 / LFM2.5 (dense) and LFM2-MoE: short gated convolutions and GQA attention.

| cache layer          | kind  | cut back                  | snapshot / batch / rollback              |
|----------------------|-------|---------------------------|------------------------------------------|
| conv (short conv)    | state | only at exact checkpoints: a conv state (last few inputs), no recurrent state | copied whole / rows stacked / saved copy, kept tokens re-run |
| full_attention       | kv    | to any prefix             | copied or shared / left-padded / cut by length |

A checkpoint inside a prefill piece is taken by splitting the prefill there.
"""  # noqa: E501 (markdown table rows, one a line)

from __future__ import annotations

from .base import FamilyAdapter


class Lfm2Adapter(FamilyAdapter):
    model_types = ("lfm2", "lfm2_moe")
    state_layers = {"conv": "state", "full_attention": "kv"}

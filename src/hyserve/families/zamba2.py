"""Zyphra Zamba2: Mamba2 layers; some also run a shared attention block (weights shared, KV per layer).

| cache layer                  | kind  | cut back                  | snapshot / batch / rollback              |
|------------------------------|-------|---------------------------|------------------------------------------|
| linear_attention (Mamba2)    | state | only at exact checkpoints | copied whole / rows stacked / saved copy, kept tokens re-run |
| hybrid (shared attention + Mamba2) | both | never: its Mamba2 state only at exact checkpoints | KV copied or shared and state copied / KV left-padded, state rows stacked / state saved, KV cut by length, kept tokens re-run |

A checkpoint inside a prefill piece is taken by splitting the prefill there.
"""  # noqa: E501 (markdown table rows, one a line)

from __future__ import annotations

from .base import FamilyAdapter


class Zamba2Adapter(FamilyAdapter):
    model_types = ("zamba2",)
    state_layers = {"linear_attention": "state", "hybrid": "both"}

"""NVIDIA Nemotron-H (Nemotron-H, Nemotron Nano 9B v2, Nemotron 3 Nano): Mamba2 layers, a few attention
layers, and MLP or MoE layers that keep no state.

| cache layer                | kind  | cut back                | snapshot / batch / rollback              |
|----------------------------|-------|-------------------------|------------------------------------------|
| linear_attention (Mamba2)  | state | only at exact checkpoints | copied whole / rows stacked / saved copy, kept tokens re-run |
| full_attention             | kv    | to any prefix           | copied or shared / left-padded / cut by length |
| moe, mlp                   | none  | nothing held            | nothing                                  |

A checkpoint inside a prefill piece is taken by splitting the prefill there (no capturing kernels).
"""  # noqa: E501 (markdown table rows, one a line)

from __future__ import annotations

from .base import FamilyAdapter


class NemotronHAdapter(FamilyAdapter):
    model_types = ("nemotron_h",)
    state_layers = {"linear_attention": "state", "full_attention": "kv", "moe": "none", "mlp": "none"}

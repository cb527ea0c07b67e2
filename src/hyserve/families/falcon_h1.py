"""TII Falcon-H1: every layer runs Mamba2 and attention in parallel, so every cache layer is hybrid.

| cache layer                | kind | cut back                                   | snapshot / batch / rollback |
|----------------------------|------|--------------------------------------------|-----------------------------|
| hybrid (Mamba2 + attention)| both | never: its Mamba2 state only at exact checkpoints (its KV alone could be) | KV copied or shared and state copied / KV left-padded, state rows stacked / state saved, KV cut by length, kept tokens re-run |

A checkpoint inside a prefill piece is taken by splitting the prefill there.
"""  # noqa: E501 (markdown table rows, one a line)

from __future__ import annotations

from .base import FamilyAdapter


class FalconH1Adapter(FamilyAdapter):
    model_types = ("falcon_h1",)
    state_layers = {"hybrid": "both"}

"""Mamba2: a pure state-space model. Every layer is a conv + SSM state that exists only at exact
checkpoints (nothing is cut back); snapshots copy it, batches stack it, rollback re-runs kept tokens."""

from __future__ import annotations

from .base import FamilyAdapter


class Mamba2Adapter(FamilyAdapter):
    """Pure state-space model: every layer is conv + SSM state; nothing can be truncated."""

    model_types = ("mamba2",)
    state_layers = {"linear_attention": "state"}

    def batch_inputs(self, mask, positions) -> dict:
        return {}  # no attention and no positions: fixed-size states stack as they are

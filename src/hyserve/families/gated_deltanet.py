"""Qwen3.5 (dense and MoE) and Qwen3-Next: Gated DeltaNet (linear attention) layers interleaved with full attention.

| cache layer      | kind                          | snapshot / restore            | batched            | rollback          |
|------------------|-------------------------------|-------------------------------|--------------------|-------------------|
| full_attention   | KV: cut back to any prefix    | copy / shared until appended  | left-padded KV     | cut to the point  |
| linear_attention | conv + delta-rule state: only | copy (fixed size)             | stacked rows       | saved copy, re-run|
|                  | at exact checkpoints          |                               |                    | the kept tokens   |

Checkpoints inside a prefill piece come from hyserve's own kernels (`forward_capturing`).
"""  # noqa: E501 (markdown table rows, one a line)

from __future__ import annotations

import copy

import torch

from ..state.layer_kinds import kind
from ..state.snapshot import LiveState
from .base import FamilyAdapter


class HybridLinearAttentionAdapter(FamilyAdapter):
    """Gated DeltaNet (linear attention) layers interleaved with full attention: Qwen3.5, Qwen3.5-MoE, Qwen3-Next.

    hyserve's own conv and delta-rule kernels can hand out the state at any token inside a prefill piece
    (`kernels.capture`), so a checkpoint boundary needs no pass of its own. That needs those kernels, which
    run only on the model thread, and only once the load-time check has seen them capture exactly."""

    model_types = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next")
    state_layers = {"linear_attention": "state", "full_attention": "kv"}
    captures_with_kernels = True

    def can_capture(self) -> bool:
        from .. import model_thread

        return self.kernels.on("capture") and model_thread.on_model_thread()

    @torch.inference_mode()
    def forward_capturing(self, state, token_ids, offsets):
        from .. import kernels

        start = state.position
        with kernels.capture(len(token_ids), offsets) as cap:
            logits = self.forward(state, token_ids)
        if cap.unexpected or len(cap.conv) != len(cap.recurrent):
            return logits, None
        states = [
            self._state_at(state, start + o, [c[i] for c in cap.conv], [r[i] for r in cap.recurrent])
            for i, o in enumerate(cap.offsets)
        ]
        return logits, None if None in states else states

    @staticmethod
    def _state_at(state: LiveState, length: int, conv: list, recurrent: list) -> LiveState | None:
        """`state`'s cache as it was after `length` tokens: attention KV cut there (views), the captured conv
        and recurrent states in the linear layers (one each, in layer order). None when the captured states
        are not exactly one per linear layer, or a layer cannot be had at a prefix this way."""
        memo: dict[int, object] = {}
        captured = iter(zip(conv, recurrent))
        if not all(kind(layer).at_prefix(layer, length, captured, memo) for layer in state.cache.layers):
            return None
        if next(captured, None) is not None:
            return None
        return LiveState(cache=copy.deepcopy(state.cache, memo), tokens=state.tokens[:length])

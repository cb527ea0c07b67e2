"""Attention-only models: every layer is KV, cut back to any prefix exactly (truncation, and rollback
by cutting with no compute)."""

from __future__ import annotations

from .base import FamilyAdapter


class AttentionAdapter(FamilyAdapter):
    """Plain attention models: the KV cache truncates to any prefix."""

    model_types = ("qwen3", "qwen2", "llama")
    has_recurrent_layers = False
    state_layers = {"full_attention": "kv"}

"""AI21 Jamba: Mamba (v1) layers with an attention layer every few, MoE MLPs.

| cache layer                  | kind  | cut back                  | snapshot / batch / rollback              |
|------------------------------|-------|---------------------------|------------------------------------------|
| linear_attention (Mamba v1)  | state | only at exact checkpoints | copied whole / rows stacked / saved copy, kept tokens re-run |
| full_attention               | kv    | to any prefix             | copied or shared / left-padded / cut by length |

transformers' Jamba scan over several tokens starts from a zero state whatever the cache holds (its own
TODO says so); only its one-token decode step reads the state. So a piece that extends a non-empty state
(a cached turn, a verify pass, a rollback's kept tokens) runs one token per pass: exact, and slower
than a prefill from empty, which is one pass as usual.
"""  # noqa: E501 (markdown table rows, one a line)

from __future__ import annotations

from .base import FamilyAdapter


class JambaAdapter(FamilyAdapter):
    model_types = ("jamba",)
    state_layers = {"linear_attention": "state", "full_attention": "kv"}
    one_token_after_start = True

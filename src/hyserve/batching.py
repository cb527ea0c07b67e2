"""Batched decode over requests that each own a live state: one token from each in a single forward
pass.

Recurrent layers (conv + SSM / delta-rule state) have a fixed size, so gathering them is a
concatenation along the batch dimension. Attention KV differs in length per request: it is
left-padded to the longest, masked out with an attention mask, and every row gets its own position.

The batched cache outlives the step (`DecodeBatch`). After a pass each request's state becomes a set
of views of its own row, so nothing is copied back; when the next step decodes the same requests in
the same order and none of their states was touched in between, the same batched cache runs again
with no gathering at all. Otherwise it is gathered afresh from the requests' states (views or not).
Gathering and scattering copies cost O(total KV) per step; at 16 requests of 2k tokens that was four
copies of every request's KV per token, now it is the one the model's own cache update makes.

A state that holds views never leaks the batch: snapshots and rollback points copy only the view's
own elements (`state.clone_cache`), and any per-request forward, rewind or truncation marks the state
as no longer in the batch.
"""

from __future__ import annotations

from typing import Sequence

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from .state import LiveState


class DecodeBatch:
    """The batched cache of the last decode pass, and which states (and positions) it holds."""

    def __init__(self, cache: DynamicCache, states: Sequence[LiveState], pads: list[int]):
        self.cache = cache
        self.states = list(states)
        self.pads = pads  # left padding of each row in the attention KV
        self.positions = [s.position for s in states]

    def holds(self, states: Sequence[LiveState]) -> bool:
        """True when `states` are exactly this batch's rows, in order, each untouched since the pass."""
        return (len(states) == len(self.states)
                and all(a is b and a.batch is self and a.position == p
                        for a, b, p in zip(states, self.states, self.positions)))

    def inputs(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention mask for one more token per row, and each row's position."""
        width = max(p + n for p, n in zip(self.pads, self.positions)) + 1
        mask = torch.zeros(len(self.states), width, dtype=torch.long, device=device)
        for i, p in enumerate(self.pads):
            mask[i, p:] = 1
        positions = torch.tensor(self.positions, dtype=torch.long, device=device).view(-1, 1)
        return mask, positions


def gather(states: Sequence[LiveState], config, device) -> DecodeBatch:
    """A batched cache of `states` (copies; the states are left as they are)."""
    lengths = [s.position for s in states]
    longest = max(lengths)
    batch = DynamicCache(config=config)
    for li, layer in enumerate(batch.layers):
        rows = [s.cache.layers[li] for s in states]
        if type(layer) is DynamicLayer:
            keys, values = _left_padded(rows, "keys", longest), _left_padded(rows, "values", longest)
            layer.lazy_initialization(keys, values)
            layer.keys, layer.values = keys, values
            continue
        for idx in range(layer.number_of_states):
            if rows[0].conv_states[idx] is not None:
                conv = torch.cat([r.conv_states[idx] for r in rows])
                layer.lazy_initialization(conv_states=conv, state_idx=idx)
                layer.conv_states[idx] = conv
            if rows[0].recurrent_states[idx] is not None:
                rec = torch.cat([r.recurrent_states[idx] for r in rows])
                layer.lazy_initialization(recurrent_states=rec, state_idx=idx)
                layer.recurrent_states[idx] = rec
            layer.has_previous_state[idx] = rows[0].has_previous_state[idx]
    return DecodeBatch(batch, states, [longest - n for n in lengths])


def _left_padded(rows, name: str, longest: int) -> torch.Tensor:
    """Rows' KV tensors [1, heads, n_i, d] as one [rows, heads, longest, d], right-aligned: one copy."""
    first = getattr(rows[0], name)
    out = first.new_empty((len(rows), first.shape[1], longest, first.shape[3]))
    for i, r in enumerate(rows):
        t = getattr(r, name)
        n = t.shape[-2]
        out[i, :, : longest - n].zero_()
        out[i, :, longest - n :] = t[0]
    return out


def scatter(batch: DecodeBatch, tokens: Sequence[int]) -> None:
    """After a pass: every state becomes views of its own row of the batched cache (no copies)."""
    for li, layer in enumerate(batch.cache.layers):
        for i, state in enumerate(batch.states):
            own = state.cache.layers[li]
            if type(layer) is DynamicLayer:
                own.keys = layer.keys[i : i + 1, :, batch.pads[i] :, :]
                own.values = layer.values[i : i + 1, :, batch.pads[i] :, :]
                continue
            for idx in range(layer.number_of_states):
                if layer.conv_states[idx] is not None:
                    own.conv_states[idx] = layer.conv_states[idx][i : i + 1]
                if layer.recurrent_states[idx] is not None:
                    own.recurrent_states[idx] = layer.recurrent_states[idx][i : i + 1]
    for state, token in zip(batch.states, tokens):
        state.tokens.append(int(token))
        state.batch = batch
    batch.positions = [s.position for s in batch.states]

"""The cache layers of a decode batch whose attention KV grows in place (`decode_batch`).

`DynamicLayer.update` concatenates each new token onto the KV, which copies the whole batch every step.
These layers keep spare columns instead: a step writes its token into them, and only when they run out is
the buffer reallocated, with room for a quarter more."""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer, LinearAttentionAndFullAttentionLayer

SPARE = 64  # spare KV columns per gather: that many steps run before the batch KV is reallocated


class GrowingKV:
    """Batch attention KV over a buffer with spare columns: `update` writes the new tokens in place and
    returns views; when the buffer is full it reallocates with room for a quarter more (at least SPARE)."""

    def _grow_over(self, keys: torch.Tensor, values: torch.Tensor, length: int) -> None:
        DynamicLayer.lazy_initialization(self, keys[:, :, :0], values[:, :, :0])
        self._k, self._v = keys, values
        self.keys, self.values = keys[:, :, :length], values[:, :, :length]

    def update(self, key_states, value_states, *args, **kwargs):
        n, k = self.keys.shape[-2], key_states.shape[-2]
        if n + k > self._k.shape[-2]:

            def grow(t):
                return torch.cat([t[:, :, :n], t.new_zeros((*t.shape[:2], k + max(SPARE, n // 4), t.shape[3]))], dim=-2)

            self._k, self._v = grow(self._k), grow(self._v)
        self._k[:, :, n : n + k] = key_states
        self._v[:, :, n : n + k] = value_states
        self.keys, self.values = self._k[:, :, : n + k], self._v[:, :, : n + k]
        return self.keys, self.values


class GrowingLayer(GrowingKV, DynamicLayer):
    """A full-attention layer of the batch."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, length: int):
        DynamicLayer.__init__(self)
        self._grow_over(keys, values, length)


class GrowingHybridLayer(GrowingKV, LinearAttentionAndFullAttentionLayer):
    """A hybrid layer of the batch (Falcon-H1, Zamba2): growing KV beside stacked conv and recurrent states."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, length: int, number_of_states: int):
        LinearAttentionAndFullAttentionLayer.__init__(self, number_of_states=number_of_states)
        self._grow_over(keys, values, length)


def left_padded(rows, name: str, longest: int, room: int = 0) -> torch.Tensor:
    """Rows' KV tensors [1, heads, n_i, d] as one [rows + room, heads, longest + SPARE, d], right-aligned at
    `longest` (the `room` rows all zero: padding): one copy."""
    first = getattr(rows[0], name)
    out = first.new_empty((len(rows) + room, first.shape[1], longest + SPARE, first.shape[3]))
    out[len(rows) :, :, :longest].zero_()
    for i, r in enumerate(rows):
        t = getattr(r, name)
        n = t.shape[-2]
        out[i, :, : longest - n].zero_()
        out[i, :, longest - n : longest] = t[0]
    return out

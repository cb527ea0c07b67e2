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
copies of every request's KV per token. The batch's attention layers also keep spare columns, so a
step writes its token in place where `DynamicLayer.update` would concatenate (copy) the whole batch.

A state that holds views never leaks the batch: snapshots and rollback points copy only the view's
own elements (`state.clone_cache`), and any per-request forward, rewind or truncation marks the state
as no longer in the batch.
"""

from __future__ import annotations

import itertools
from typing import Sequence

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from .state import LiveState


SPARE = 64  # spare KV columns per gather: that many steps run before the batch KV is reallocated


class _GrowingLayer(DynamicLayer):
    """Batch attention KV over a buffer with spare columns: `update` writes the new tokens in place and
    returns views; when the buffer is full it reallocates with room for a quarter more (at least SPARE)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, length: int):
        super().__init__()
        self.lazy_initialization(keys[:, :, :0], values[:, :, :0])
        self._k, self._v = keys, values
        self.keys, self.values = keys[:, :, :length], values[:, :, :length]

    def update(self, key_states, value_states, *args, **kwargs):
        n, k = self.keys.shape[-2], key_states.shape[-2]
        if n + k > self._k.shape[-2]:
            grow = lambda t: torch.cat([t[:, :, :n], t.new_zeros((*t.shape[:2], k + max(SPARE, n // 4), t.shape[3]))],
                                       dim=-2)  # noqa: E731
            self._k, self._v = grow(self._k), grow(self._v)
        self._k[:, :, n : n + k] = key_states
        self._v[:, :, n : n + k] = value_states
        self.keys, self.values = self._k[:, :, : n + k], self._v[:, :, : n + k]
        return self.keys, self.values


class DecodeBatch:
    """The batched cache of the last decode pass, and which states (and positions) it holds.

    Neither side holds the other: a state carries only the batch's serial number and the batch only
    the states' ids, so no reference cycle keeps a finished request's rows (or an old batch's
    buffers) alive until the cyclic garbage collector happens to run."""

    _serials = itertools.count(1)

    def __init__(self, cache: DynamicCache, states: Sequence[LiveState], pads: list[int]):
        self.cache = cache
        self.serial = next(self._serials)
        self.ids = [id(s) for s in states]
        self.pads = pads  # left padding of each row in the attention KV
        self.positions = [s.position for s in states]

    def holds(self, states: Sequence[LiveState]) -> bool:
        """True when `states` are exactly this batch's rows, in order, each untouched since the pass (an
        id reused by a new object fails the serial check: only a pass of this batch sets it)."""
        return (len(states) == len(self.ids)
                and all(id(a) == i and a.batch == self.serial and a.position == p
                        for a, i, p in zip(states, self.ids, self.positions)))

    def inputs(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention mask for one more token per row, and each row's position."""
        width = max(p + n for p, n in zip(self.pads, self.positions)) + 1
        mask = torch.zeros(len(self.ids), width, dtype=torch.long, device=device)
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
            batch.layers[li] = _GrowingLayer(keys, values, longest)
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
    """Rows' KV tensors [1, heads, n_i, d] as one [rows, heads, longest + SPARE, d], right-aligned at
    `longest`: one copy."""
    first = getattr(rows[0], name)
    out = first.new_empty((len(rows), first.shape[1], longest + SPARE, first.shape[3]))
    for i, r in enumerate(rows):
        t = getattr(r, name)
        n = t.shape[-2]
        out[i, :, : longest - n].zero_()
        out[i, :, longest - n : longest] = t[0]
    return out


def scatter(batch: DecodeBatch, states: Sequence[LiveState], tokens: Sequence[int]) -> None:
    """After a pass: every state becomes views of its own row of the batched cache (no copies)."""
    for li, layer in enumerate(batch.cache.layers):
        for i, state in enumerate(states):
            own = state.cache.layers[li]
            if isinstance(layer, _GrowingLayer):
                own.keys = layer.keys[i : i + 1, :, batch.pads[i] :, :]
                own.values = layer.values[i : i + 1, :, batch.pads[i] :, :]
                continue
            for idx in range(layer.number_of_states):
                if layer.conv_states[idx] is not None:
                    own.conv_states[idx] = layer.conv_states[idx][i : i + 1]
                if layer.recurrent_states[idx] is not None:
                    own.recurrent_states[idx] = layer.recurrent_states[idx][i : i + 1]
    for state, token in zip(states, tokens):
        state.tokens.append(int(token))
        state.batch = batch.serial
    batch.positions = [s.position for s in states]

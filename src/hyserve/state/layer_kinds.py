"""Kinds of cache layer, each one object that carries every operation hyserve does on such a layer.

transformers builds one cache layer per model layer from the config's layer types. hyserve handles each by
what it holds, never by which family it came from (as mlx-lm's cache classes and vLLM's KV cache specs do):

=========================================  ======  =====================================================
transformers layer (layer type)            kind    cut back / saved
=========================================  ======  =====================================================
DynamicLayer (full_attention)              kv      cut to any shorter prefix; KV copied or shared
LinearAttentionLayer (linear_attention,    state   only at exact checkpoints: conv (+ SSM / delta-rule)
  conv)                                            state of fixed size, copied whole
LinearAttentionAndFullAttentionLayer       both    KV cut like `kv`, its state only at checkpoints
  (hybrid: Falcon-H1, Zamba2)
DummyLayer (moe, mlp)                      none    nothing to keep
=========================================  ======  =====================================================

Anything else (sliding-window KV, whose old tokens are gone) is `opaque`: never cut back, copied whole, never
batched.

The rest of the state layer never asks what a layer is: it loops over `kind(layer).op(layer, ...)`, so a
new kind of layer is a class here and a line in `kind`. The operations:

- what it holds: `tensors` (every state tensor, for copying and counting), `kv` / `set_kv` (the attention
  KV that only ever grows by appending: shared with snapshots, kept in KV-chain segments), `kv_length`,
  `set_seen_tokens` (transformers' own token count in a linear-attention layer);
- cutting back: `trims` (the whole layer can be cut to any shorter prefix), `cut_kv`, and for a verify
  pass's rollback `save` / `put_back` (a copy of what cannot be cut, nothing for what can);
- `at_prefix`: a copy of the layer at an earlier length from states captured inside a prefill piece;
- a decode batch: `batch_layer` (the rows of many states in one layer), `write_row` (one state into its
  row), `view_row` (a state's layer made views of its row).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator

import torch
from transformers.cache_utils import (
    DummyLayer,
    DynamicLayer,
    LinearAttentionAndFullAttentionLayer,
    LinearAttentionLayer,
)

from .batch_layers import GrowingHybridLayer, GrowingLayer, left_padded

KVPair = tuple[torch.Tensor, torch.Tensor]


def _kv_tensors(layer) -> Iterator[torch.Tensor]:
    for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
        if isinstance(t, torch.Tensor):
            yield t


def _state_tensors(layer) -> Iterator[torch.Tensor]:
    for name in ("conv_states", "recurrent_states"):
        states = getattr(layer, name, None)
        if isinstance(states, dict):
            yield from (t for t in states.values() if isinstance(t, torch.Tensor))


def _set_count(layer, n: int) -> None:
    count = getattr(layer, "cumulative_length_linear", None)
    if isinstance(count, torch.Tensor):
        count.fill_(n)


class LayerKind:
    """A layer that holds nothing to keep (transformers' `DummyLayer`: the MoE and MLP layers of Nemotron-H).
    The base of the other kinds: here every operation has nothing to do."""

    name = "none"
    trims = True  # the whole layer can be cut back to any shorter prefix (mlx-lm's `is_trimmable`)

    # -- what it holds ----------------------------------------------------------------------
    def tensors(self, layer) -> Iterator[torch.Tensor]:
        """Every state tensor of the layer (a tensor viewed twice is listed twice: callers count it once)."""
        return iter(())

    def kv(self, layer) -> KVPair | None:
        """(keys, values) of full-attention KV, which `update` only ever extends by concatenation (never a
        sliding window, which drops old tokens), or None when the layer holds none."""
        return None

    def set_kv(self, layer, keys: torch.Tensor | None, values: torch.Tensor | None) -> None:
        raise TypeError(f"a {self.name!r} layer holds no attention KV")

    def kv_length(self, layer) -> int | None:
        """Tokens its attention KV holds, or None when it holds no attention KV."""
        return None

    def set_seen_tokens(self, layer, n: int) -> None:
        """Tell the layer it has absorbed `n` tokens (see `caches.set_seen_tokens`)."""

    # -- cutting back -----------------------------------------------------------------------
    def cut_kv(self, layer, length: int, copy: bool = False) -> None:
        """Keep the first `length` tokens of its attention KV, if it holds any: views (the next `update`
        concatenates into new tensors anyway) or, with `copy`, compact copies."""

    def save(self, layer):
        """What a rollback needs to put the layer back as it is now (`put_back`); None when cutting its KV
        back by length is enough."""
        return None

    def put_back(self, layers: list, index: int, saved) -> None:
        """Put back what `save` took from `layers[index]`."""

    def at_prefix(
        self, layer, length: int, captured: Iterator[tuple[torch.Tensor, torch.Tensor]], memo: dict[int, object]
    ) -> bool:
        """Fill `memo` (for `copy.deepcopy` of the cache) so that the copy of this layer is the layer as it
        was after `length` tokens, taking its (conv, recurrent) states, if it has any, from `captured` (one
        pair per layer that has them, in layer order). False when that cannot be had for this kind."""
        return True

    # -- decode batch -----------------------------------------------------------------------
    def batch_layer(self, fresh, rows: list, longest: int, room: int):
        """The batch's layer holding `rows` (the states' layers) in rows 0.. and `room` zero rows after
        them, attention KV right-aligned at `longest`; `fresh` is the empty layer the batch cache made."""
        return fresh

    def write_row(self, layer, row: int, own, pad: int, width: int) -> None:
        """Copy the state's layer `own` into `row` of the batch's `layer`, its KV right-aligned at `width`
        after `pad` columns of zeros (masked, and a masked value must not be a NaN)."""

    def view_row(self, layer, row: int, own, pad: int) -> None:
        """Make the state's layer `own` views of `row` of the batch's `layer` (its KV from column `pad`)."""


class AttentionKV(LayerKind):
    """Full-attention KV (`DynamicLayer`): cut back to any prefix exactly; grows by appending only."""

    name = "kv"

    def tensors(self, layer):
        yield from _kv_tensors(layer)
        yield from super().tensors(layer)

    def kv(self, layer):
        return (layer.keys, layer.values) if isinstance(getattr(layer, "keys", None), torch.Tensor) else None

    def set_kv(self, layer, keys, values):
        layer.keys, layer.values = keys, values

    def kv_length(self, layer):
        return DynamicLayer.get_seq_length(layer)

    def cut_kv(self, layer, length, copy=False):
        if layer.keys is not None and layer.keys.numel():
            keys, values = layer.keys[..., :length, :], layer.values[..., :length, :]
            layer.keys, layer.values = (keys.clone(), values.clone()) if copy else (keys, values)

    def at_prefix(self, layer, length, captured, memo):
        pair = self.kv(layer)
        for t in pair or ():
            memo[id(t)] = t[..., :length, :]
        return super().at_prefix(layer, length, captured, memo)

    def batch_layer(self, fresh, rows, longest, room):
        keys, values = left_padded(rows, "keys", longest, room), left_padded(rows, "values", longest, room)
        return GrowingLayer(keys, values, longest)

    def write_row(self, layer, row, own, pad, width):
        for buf, t in ((layer._k, own.keys), (layer._v, own.values)):
            buf[row, :, :pad].zero_()
            buf[row, :, pad:width] = t[0]
        super().write_row(layer, row, own, pad, width)

    def view_row(self, layer, row, own, pad):
        own.keys = layer.keys[row : row + 1, :, pad:, :]
        own.values = layer.values[row : row + 1, :, pad:, :]
        super().view_row(layer, row, own, pad)


def _whole_copy(kind: LayerKind, layer):
    """A deep copy of the layer in which every state tensor is a compact clone (a view of a batch row
    copies only its row)."""
    return copy.deepcopy(layer, {id(t): t.clone() for t in kind.tensors(layer)})


class Recurrent(LayerKind):
    """Conv + SSM / delta-rule state of fixed size (`LinearAttentionLayer`): exact only at the token count it
    was taken at, so never cut back; a rollback puts back a saved copy and re-runs the kept tokens."""

    name = "state"
    trims = False

    def tensors(self, layer):
        yield from _state_tensors(layer)
        yield from super().tensors(layer)

    def set_seen_tokens(self, layer, n):
        _set_count(layer, n)
        super().set_seen_tokens(layer, n)

    def save(self, layer):
        return _whole_copy(self, layer)

    def put_back(self, layers, index, saved):
        layers[index] = saved

    def at_prefix(self, layer, length, captured, memo):
        pair = next(captured, None)
        if pair is None or layer.number_of_states != 1:
            return False
        conv, recurrent = pair
        memo[id(layer.conv_states[0])] = conv
        memo[id(layer.recurrent_states[0])] = recurrent.to(layer.recurrent_states[0].dtype)
        return super().at_prefix(layer, length, captured, memo)

    def batch_layer(self, fresh, rows, longest, room):
        self._stack(fresh, rows, room)
        return fresh

    @staticmethod
    def _stack(layer, rows, room) -> None:
        """Each state of `rows` concatenated along the batch dimension into `layer`, and `room` zero rows."""
        for idx in range(layer.number_of_states):
            if rows[0].conv_states[idx] is not None:
                first = rows[0].conv_states[idx]
                conv = torch.cat([r.conv_states[idx] for r in rows] + [first.new_zeros(first.shape)] * room)
                layer.lazy_initialization(conv_states=conv, state_idx=idx)
                layer.conv_states[idx] = conv
            if rows[0].recurrent_states[idx] is not None:
                first = rows[0].recurrent_states[idx]
                rec = torch.cat([r.recurrent_states[idx] for r in rows] + [first.new_zeros(first.shape)] * room)
                layer.lazy_initialization(recurrent_states=rec, state_idx=idx)
                layer.recurrent_states[idx] = rec
            layer.has_previous_state[idx] = rows[0].has_previous_state[idx]

    def write_row(self, layer, row, own, pad, width):
        for idx in range(layer.number_of_states):
            if layer.conv_states[idx] is not None:
                layer.conv_states[idx][row].copy_(own.conv_states[idx][0])
            if layer.recurrent_states[idx] is not None:
                layer.recurrent_states[idx][row].copy_(own.recurrent_states[idx][0])
        super().write_row(layer, row, own, pad, width)

    def view_row(self, layer, row, own, pad):
        for idx in range(layer.number_of_states):
            if layer.conv_states[idx] is not None:
                own.conv_states[idx] = layer.conv_states[idx][row : row + 1]
            if layer.recurrent_states[idx] is not None:
                own.recurrent_states[idx] = layer.recurrent_states[idx][row : row + 1]
        super().view_row(layer, row, own, pad)


_STATE_FIELDS = (
    "conv_states",
    "recurrent_states",
    "has_previous_state",
    "is_conv_states_initialized",
    "is_recurrent_states_initialized",
)


class Hybrid(AttentionKV, Recurrent):
    """Attention KV and a recurrent state in one layer (`LinearAttentionAndFullAttentionLayer`: Falcon-H1,
    Zamba2). Each operation does the KV's part, then the state's (`AttentionKV`, then `Recurrent`, by
    method resolution order); the layer as a whole is never cut back, since its state cannot be."""

    name = "both"
    trims = False

    def save(self, layer):
        """Its conv and recurrent states alone: its KV is cut back by length."""
        return {
            name: {
                i: (t.clone() if t is not None and hasattr(t, "clone") else t) for i, t in getattr(layer, name).items()
            }
            for name in _STATE_FIELDS
        }

    def put_back(self, layers, index, saved):
        for name, values in saved.items():
            setattr(layers[index], name, dict(values))

    def at_prefix(self, layer, length, captured, memo):
        return False  # no kernel captures inside a hybrid layer

    def batch_layer(self, fresh, rows, longest, room):
        keys, values = left_padded(rows, "keys", longest, room), left_padded(rows, "values", longest, room)
        layer = GrowingHybridLayer(keys, values, longest, rows[0].number_of_states)
        self._stack(layer, rows, room)
        return layer


class Opaque(LayerKind):
    """Any other layer (sliding-window KV, whose old tokens are gone): never cut back, copied whole, its
    tensors found by name."""

    name = "opaque"
    trims = False

    def tensors(self, layer):
        yield from _kv_tensors(layer)
        yield from _state_tensors(layer)

    def set_seen_tokens(self, layer, n):
        _set_count(layer, n)

    def save(self, layer):
        return _whole_copy(self, layer)

    def put_back(self, layers, index, saved):
        layers[index] = saved

    def at_prefix(self, layer, length, captured, memo):
        return False

    def batch_layer(self, fresh, rows, longest, room):
        """Refused: the batch's empty layer would stand in for its tokens, and every row would decode wrong."""
        raise NotImplementedError(f"a {type(rows[0]).__name__} (a layer of kind 'opaque') cannot join a decode batch")


NONE, KV, STATE, BOTH, OPAQUE = LayerKind(), AttentionKV(), Recurrent(), Hybrid(), Opaque()


def kind(layer) -> LayerKind:
    """The kind of a cache layer (a decode batch's layers count as what they extend)."""
    if isinstance(layer, LinearAttentionAndFullAttentionLayer):
        return BOTH
    if isinstance(layer, LinearAttentionLayer):
        return STATE
    if isinstance(layer, DummyLayer):
        return NONE
    if isinstance(layer, DynamicLayer) and not getattr(layer, "is_sliding", False):
        return KV
    return OPAQUE

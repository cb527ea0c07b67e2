"""Kinds of cache layer, as mlx-lm's cache types say them: what a layer holds, whether it can be cut back.

transformers builds one cache layer per model layer from the config's layer types. hyserve handles four
kinds, each by what it holds, never by which family it came from:

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

Anything else (sliding-window KV, whose old tokens are gone) is `opaque`: never cut back, copied whole.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers.cache_utils import DummyLayer, DynamicLayer, LinearAttentionAndFullAttentionLayer, LinearAttentionLayer

from .snapshot import clone_cache


@dataclass(frozen=True)
class Kind:
    name: str
    kv: bool  # holds full-attention KV, which can be cut to any shorter prefix exactly
    state: bool  # holds a fixed-size recurrent state (conv, SSM, delta rule): exact only where it was taken

    @property
    def trims(self) -> bool:
        """Whether the whole layer can be cut back to any shorter prefix."""
        return not self.state and self.name != "opaque"


KV, STATE, BOTH, NONE, OPAQUE = (Kind("kv", True, False), Kind("state", False, True), Kind("both", True, True),
                                 Kind("none", False, False), Kind("opaque", False, False))


def kind(layer) -> Kind:
    """The kind of a cache layer (hyserve's batch layers count as what they extend)."""
    if isinstance(layer, LinearAttentionAndFullAttentionLayer):
        return BOTH
    if isinstance(layer, LinearAttentionLayer):
        return STATE
    if isinstance(layer, DummyLayer):
        return NONE
    if isinstance(layer, DynamicLayer) and not getattr(layer, "is_sliding", False):
        return KV
    return OPAQUE


def holds_kv(layer) -> bool:
    return kind(layer).kv


def cut_kv(layer, length: int, copy: bool = False) -> None:
    """Keep the first `length` tokens of a layer's KV: views (the next `update` concatenates into new
    tensors anyway) or, with `copy`, compact copies."""
    if layer.keys is not None and layer.keys.numel():
        keys, values = layer.keys[..., :length, :], layer.values[..., :length, :]
        layer.keys, layer.values = (keys.clone(), values.clone()) if copy else (keys, values)


_STATE_FIELDS = ("conv_states", "recurrent_states", "has_previous_state", "is_conv_states_initialized",
                 "is_recurrent_states_initialized")


def save_state(layer):
    """A copy of what a layer holds besides its KV, to put back with `put_state`: the whole layer when
    it holds no KV (`state`, `opaque`), else its conv and recurrent states alone (its KV is cut by length)."""
    k = kind(layer)
    if not k.kv:
        return clone_cache(layer)
    return {name: {i: (t.clone() if t is not None and hasattr(t, "clone") else t)
                   for i, t in getattr(layer, name).items()} for name in _STATE_FIELDS}


def put_state(layers: list, index: int, saved) -> None:
    """Put back what `save_state` took from `layers[index]`."""
    if isinstance(saved, dict):
        for name, values in saved.items():
            setattr(layers[index], name, dict(values))
    else:
        layers[index] = saved

"""Layer kinds (`hyserve.state.layer_kinds`): one object per kind of cache layer carries every operation on it,
so what a layer is gets decided in one module; each kind's operations on real transformers layers."""

from __future__ import annotations

import ast
import pathlib

import pytest
import torch
from transformers.cache_utils import (
    DummyLayer,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    LinearAttentionAndFullAttentionLayer,
    LinearAttentionLayer,
)

import hyserve
from hyserve.state.layer_kinds import kind

# the modules that may name transformers' cache layer classes: the kinds, and the batch's own layers
_KIND_MODULES = {"state/layer_kinds.py", "state/batch_layers.py"}


def test_only_the_layer_kinds_module_names_cache_layer_classes():
    """A switch on a layer's class anywhere else (the ~17 `isinstance` / `type(layer) is` checks over six
    files that `layer_kinds` replaced) needs those classes: importing one outside it fails here."""
    root = pathlib.Path(hyserve.__file__).parent
    offenders = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        for node in ast.walk(ast.parse(path.read_text(), rel)):
            named = (
                [node.module]
                if isinstance(node, ast.ImportFrom)
                else [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else []
            )
            if "transformers.cache_utils" in named and rel not in _KIND_MODULES:
                offenders.append(f"{rel}:{node.lineno}")
    assert not offenders, offenders


def _kv(layer, n, seed):
    g = torch.Generator().manual_seed(seed)
    layer.lazy_initialization(torch.zeros(1, 2, 0, 4), torch.zeros(1, 2, 0, 4))
    layer.keys, layer.values = torch.randn(1, 2, n, 4, generator=g), torch.randn(1, 2, n, 4, generator=g)


def _state(layer, seed):
    g = torch.Generator().manual_seed(seed)
    layer.conv_states[0] = torch.randn(1, 3, 4, generator=g)
    layer.recurrent_states[0] = torch.randn(1, 2, 4, generator=g)
    layer.has_previous_state[0] = True


def _same(xs, ys) -> bool:
    xs, ys = list(xs), list(ys)
    return len(xs) == len(ys) and all(torch.equal(x, y) for x, y in zip(xs, ys))


def _layer(name, n=5, seed=0):
    if name == "kv":
        layer = DynamicLayer()
        _kv(layer, n, seed)
    elif name == "state":
        layer = LinearAttentionLayer()
        _state(layer, seed)
    elif name == "both":
        layer = LinearAttentionAndFullAttentionLayer()
        _kv(layer, n, seed)
        _state(layer, seed + 1)
    elif name == "opaque":
        layer = DynamicSlidingWindowLayer(sliding_window=4)
        _kv(layer, n, seed)
    else:
        layer = DummyLayer()
    return layer


@pytest.mark.parametrize(
    "name,trims,n_tensors,has_kv",
    [
        ("kv", True, 2, True),
        ("state", False, 2, False),
        ("both", False, 4, True),
        ("none", True, 0, False),
        ("opaque", False, 2, False),
    ],
)
def test_what_each_kind_holds(name, trims, n_tensors, has_kv):
    layer = _layer(name)
    k = kind(layer)
    assert (k.name, k.trims, len(list(k.tensors(layer)))) == (name, trims, n_tensors)
    assert (k.kv(layer) is not None) == has_kv and (k.kv_length(layer) == 5 if has_kv else k.kv_length(layer) is None)


@pytest.mark.parametrize("name", ["kv", "state", "both", "none", "opaque"])
def test_a_rollback_puts_back_exactly_what_was_saved(name):
    """Save, run on (KV appended, state overwritten in place), cut the KV back and put the rest back: every
    tensor bit for bit as before, whatever the kind."""
    layers = [_layer(name)]
    k = kind(layers[0])
    before = [t.clone() for t in k.tensors(layers[0])]
    saved = k.save(layers[0])
    assert (saved is None) == k.trims
    if k.kv(layers[0]) is not None:
        layers[0].keys = torch.cat([layers[0].keys, torch.ones(1, 2, 3, 4)], dim=-2)
        layers[0].values = torch.cat([layers[0].values, torch.ones(1, 2, 3, 4)], dim=-2)
    for t in list(k.tensors(layers[0]))[2 if k.kv(layers[0]) is not None else 0 :]:
        t.add_(1)  # a recurrent state moves on in place
    k.cut_kv(layers[0], 5)
    if saved is not None:
        k.put_back(layers, 0, saved)
    assert _same(kind(layers[0]).tensors(layers[0]), before)


@pytest.mark.parametrize("name", ["kv", "state", "both"])
def test_rows_of_a_batch_view_and_take_back_each_state(name):
    """Two states of 3 and 5 tokens in one batch layer with a free row: each state's views of its row equal it,
    and a state written into the free row reads back equal."""
    a, b = _layer(name, 3, seed=1), _layer(name, 5, seed=2)
    k = kind(a)
    fresh = type(a)() if name != "kv" else DynamicLayer()
    batch = k.batch_layer(fresh, [a, b], 5, room=1)
    assert kind(batch) is k
    for row, (own, pad) in enumerate([(a, 2), (b, 0)]):
        view = _layer(name, 1, seed=9)
        k.view_row(batch, row, view, pad)
        assert _same(k.tensors(view), k.tensors(own))
    k.write_row(batch, 2, a, 2, 5)
    view = _layer(name, 1, seed=9)
    k.view_row(batch, 2, view, 2)
    assert _same(k.tensors(view), k.tensors(a))


def test_a_sliding_window_layer_never_joins_a_decode_batch():
    """Its KV has no batched form here: a batch would decode over an empty layer in its place, wrong."""
    layer = _layer("opaque")
    with pytest.raises(NotImplementedError, match="opaque"):
        kind(layer).batch_layer(DynamicSlidingWindowLayer(sliding_window=4), [layer], 5, 0)

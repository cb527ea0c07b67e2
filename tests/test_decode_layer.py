"""The lean decoder layer for one decode token (`kernels.decode_layer`): the logits of the layers' own forward
with the same kernels, bit for bit, and it is what runs on the model thread."""

from __future__ import annotations

import pytest
import torch

from hyserve import model_thread
from hyserve.kernels import decode_layer
from hyserve.models.runtime import ModelRuntime


def _lean_layers(rt):
    return [m for m in rt.model.modules() if decode_layer.PARTS in m.__dict__]


def _decode_logits(ad):
    """Two requests of different lengths decoding together (the shorter one left-padded), then one alone."""
    states = [ad.new_state(), ad.new_state()]
    ad.forward(states[0], list(range(5, 40)))
    ad.forward(states[1], list(range(50, 61)))
    out = [ad.forward_batch(states, [7 + i, 9 + i]) for i in range(3)]
    ad.drop_batch()
    out.append(ad.forward(states[1], [13])[None])
    return torch.cat(out)


@pytest.mark.parametrize("arch,dtype", [("qwen3_5", "bfloat16"), ("qwen3_5", "float32"), ("qwen3_5_moe", "bfloat16")])
def test_the_lean_decode_layer_gives_the_layers_own_logits_bit_for_bit(model_dirs, arch, dtype):
    rt = ModelRuntime.load(model_dirs[arch], dtype=dtype, device="cpu")
    assert rt.adapter.kernels.on("decode_layer"), rt.adapter.kernels.status
    layers = _lean_layers(rt)
    assert len(layers) == rt.model.config.num_hidden_layers
    for m in layers:  # the same kernels inside: not the C step, whose float32 sums run in another order
        m.__dict__[decode_layer.PARTS].native = None  # (tests/test_native_kernels.py)
    lean = model_thread.run(_decode_logits, rt.adapter)
    own = {id(m): m.__dict__.pop("forward") for m in layers}  # the layer's own forward, the same kernels inside
    try:
        reference = model_thread.run(_decode_logits, rt.adapter)
    finally:
        for m in layers:
            m.__dict__["forward"] = own[id(m)]
    assert torch.equal(lean, reference)


def test_decode_steps_skip_the_mixer_and_mlp_modules(model_dirs, monkeypatch):
    """On the model thread a decode step never enters the Gated DeltaNet's, the attention's or the MLP's own
    forward (a prefill piece does): the lean path is what runs, not a silent fallback."""
    rt = ModelRuntime.load(model_dirs["qwen3_5"], dtype="bfloat16", device="cpu")
    ad = rt.adapter
    layer = next(m for m in _lean_layers(rt) if m.block_type == "linear_attention")
    attention = next(m for m in _lean_layers(rt) if m.block_type == "full_attention")
    state = ad.new_state()
    model_thread.run(ad.forward, state, list(range(5, 30)))

    def refuse(*args, **kwargs):
        raise AssertionError("a decode step ran the module's own forward")

    monkeypatch.setattr(type(layer.linear_attn), "forward", refuse)
    monkeypatch.setattr(type(layer.mlp), "forward", refuse)
    monkeypatch.setattr(type(attention.self_attn), "forward", refuse)
    logits = model_thread.run(lambda: [ad.forward_batch([state], [t]) for t in (3, 4)])
    assert all(torch.isfinite(x).all() for x in logits)
    with pytest.raises(AssertionError, match="own forward"):
        model_thread.run(ad.forward, state, [5, 6])  # a piece of two tokens takes the layers' own path
    ad.drop_batch()


def test_switched_off_by_the_environment(model_dirs, monkeypatch):
    monkeypatch.setenv("HYSERVE_DECODE_LAYER", "0")
    rt = ModelRuntime.load(model_dirs["qwen3_5"], device="cpu")
    assert not _lean_layers(rt)
    assert not rt.adapter.kernels.on("decode_layer")

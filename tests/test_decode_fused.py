"""The decode layers in C over int8-activation quantized weights (`decode_layer.install_fused`): on where every
product of a layer is `a8_products.c`'s, what a decode step runs (not the Python between the products), the
Python path's logits within a bfloat16 ulp and its greedy tokens, batched == each row alone, and a build that
computes wrong is refused at load (the Python path's tokens then)."""

from __future__ import annotations

import logging

import pytest
import torch

from hyserve import model_thread
from hyserve.kernels import decode_layer, native, seam, verify
from hyserve.models.runtime import ModelRuntime

from .test_decode_layer import _decode_logits, _lean_layers
from .test_engine_cache import SCRIPT
from .test_quant import _chat_matches_cache_off, _greedy


def _parts(rt):
    return [m.__dict__[decode_layer.PARTS] for m in _lean_layers(rt)]


@pytest.mark.parametrize("scheme", ["w8a8", "w4a8"])
def test_the_c_layers_give_the_python_paths_logits_and_tokens(model_dirs, scheme):
    rt = ModelRuntime.load(model_dirs["qwen3_5"], device="cpu", dtype="bfloat16", quantization=scheme)
    assert rt.kernels.on(decode_layer.FUSED), rt.kernels.status
    parts = _parts(rt)
    assert any(p.gdn is not None for p in parts) and any(p.gdn is None for p in parts)
    assert all(isinstance(p.fused, native.GdnLayer) for p in parts if p.gdn is not None)
    assert all(isinstance(p.mlp_native, native.MlpBlock) for p in parts)
    fused = model_thread.run(_decode_logits, rt.adapter)
    tokens = _greedy(rt, n=8)
    assert tokens == _greedy(rt, n=8, together=False)  # batched == each row alone
    seam.revert(rt.model, decode_layer.FUSED)
    assert all(p.fused is None and p.mlp_native is None for p in parts)
    python = model_thread.run(_decode_logits, rt.adapter)
    assert verify.mismatch(fused, python, torch.bfloat16) is None
    assert (fused.float() - python.float()).abs().max() <= 0.05 * python.float().abs().max()
    assert _greedy(rt, n=8) == tokens


@pytest.mark.parametrize("scheme", ["w8a8", "w4a8"])
def test_a_six_turn_chat_with_the_c_layers_matches_cache_off(make_service, scheme):
    """The bfloat16 chat of `test_quant`'s weight-only settings, with the C layers decoding every reply: the cache-on
    tokens are the cache-off ones (numbers within bfloat16's 2e-2 between a cached turn's pieces and a whole prompt)."""
    _chat_matches_cache_off(
        make_service, "qwen3_5", SCRIPT, 2e-2, False, kernel=decode_layer.FUSED, dtype="bfloat16", quantization=scheme
    )


def test_a_decode_step_runs_the_c_layers(model_dirs, monkeypatch):
    """A decode step never calls the Gated DeltaNet step's or the MLP's Python forms (a prefill piece does): the
    C layers are what runs, not a silent fallback."""
    rt = ModelRuntime.load(model_dirs["qwen3_5"], device="cpu", dtype="bfloat16", quantization="w4a8")
    ad = rt.adapter
    state = ad.new_state()
    model_thread.run(ad.forward, state, list(range(5, 30)))

    def refuse(*args, **kwargs):
        raise AssertionError("a decode step ran a Python form")

    monkeypatch.setattr(native.GdnStep, "__call__", refuse)
    monkeypatch.setattr(torch.nn.functional, "silu", refuse)
    logits = model_thread.run(lambda: [ad.forward_batch([state], [t]) for t in (3, 4)])
    assert all(torch.isfinite(x).all() for x in logits)
    ad.drop_batch()
    with pytest.raises(AssertionError, match="Python form"):
        model_thread.run(ad.forward, state, [5, 6])  # a piece of two tokens takes the layers' own path


def test_a_wrong_build_is_refused_at_load(model_dirs, monkeypatch, tmp_path, caplog):
    """`decode_step.c` with its MLP block's product scaled by 1.25 builds and runs; the load-time check refuses the
    C layers with the difference and a warning, the other kernels stay on, and the tokens are the Python path's."""
    good = ModelRuntime.load(model_dirs["qwen3_5"], device="cpu", dtype="bfloat16", quantization="w4a8")
    seam.revert(good.model, decode_layer.FUSED)
    right = "act[r * inter + i] = to_bf(round_bf(silu(g)) * u);"
    source = native.SOURCE.read_text()
    assert source.count(right) == 1
    (tmp_path / "decode_step.c").write_text(source.replace(right, right.replace("* u", "* u * 1.25f")))
    monkeypatch.setattr(native, "SOURCE", tmp_path / "decode_step.c")
    monkeypatch.setenv("HYSERVE_NATIVE_CACHE", str(tmp_path / "native"))
    native.library.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="hyserve.runtime"):
            rt = ModelRuntime.load(model_dirs["qwen3_5"], device="cpu", dtype="bfloat16", quantization="w4a8")
    finally:
        native.library.cache_clear()
    assert rt.kernels.status[decode_layer.FUSED].startswith("off: max |diff|"), rt.kernels.status
    assert rt.kernels.on("native_gdn_step") and rt.kernels.on("native_norm"), rt.kernels.status
    assert any("the C decode layers are off" in r.message for r in caplog.records)
    assert all(p.fused is None and p.mlp_native is None for p in _parts(rt))
    assert _greedy(rt, n=6) == _greedy(good, n=6)


def test_weight_only_and_float_models_keep_the_python_path(model_dirs):
    """Weight-only int8 widens each weight in its own C product (no `a8_linear` to hand in) and a float model has
    no C products: neither reports the C layers."""
    for kwargs in ({"quantization": "int8"}, {}):
        rt = ModelRuntime.load(model_dirs["qwen3_5"], device="cpu", dtype="bfloat16", **kwargs)
        assert decode_layer.FUSED not in rt.kernels.status, rt.kernels.status
        assert all(p.fused is None and p.mlp_native is None for p in _parts(rt))

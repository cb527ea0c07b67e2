"""The C Gated DeltaNet decode step (`kernels.native`, `gdn_step.c`): the PyTorch operations' results, what
a bfloat16 decode step runs, checked at load (a wrong build is refused), off without a compiler."""

from __future__ import annotations

import pytest
import torch

from hyserve import model_thread
from hyserve.kernels import decode_layer, native
from hyserve.runtime import ModelRuntime


@pytest.fixture
def fresh_library(monkeypatch, tmp_path):
    """Each load builds or refuses anew, into a cache folder of the test's own."""
    monkeypatch.setenv("HYSERVE_NATIVE_CACHE", str(tmp_path / "native"))
    native.library.cache_clear()
    yield
    native.library.cache_clear()


def _gdn_parts(rt):
    return [p for p in (m.__dict__.get(decode_layer.PARTS) for m in rt.model.modules()) if p and p.gdn is not None]


def _inputs(p, rows, seed):
    key_dim, value_dim, hk, dk, hv, dv = p.dims
    channels = 2 * key_dim + value_dim
    g = torch.Generator().manual_seed(seed)
    y = (torch.randn(rows, 1, channels + value_dim + 2 * hv, generator=g) * 2).to(torch.bfloat16)
    y[0, :, -hv:] += 25  # above softplus' threshold
    conv_state = torch.randn(rows, channels, p.taps.shape[1], generator=g).to(torch.bfloat16)
    state = torch.randn(rows, hv, dk, dv, generator=g) * 0.3
    return torch.split(y, [channels, value_dim, hv, hv], dim=-1), conv_state, state


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe"])
def test_the_c_step_gives_the_pytorch_operations_results(model_dirs, arch):
    rt = ModelRuntime.load(model_dirs[arch], dtype="bfloat16", device="cpu")
    assert rt.adapter.kernels.on("native_gdn_step"), rt.adapter.kernels.status
    parts = _gdn_parts(rt)
    assert parts and all(p.native is not None for p in parts)
    for rows in (1, 2, 5):
        for p in parts[:2]:
            (mixed, z, b, a), conv_state, state = _inputs(p, rows, rows)
            conv_c, state_c = conv_state.clone(), state.clone()
            with torch.inference_mode():
                got = p.native(mixed, z, b, a, conv_c, state_c)
                want, new = decode_layer.gdn_between_products(p, mixed, z, b, a, conv_state, state)
            assert torch.equal(conv_c, conv_state)  # the shifted window, bit for bit
            torch.testing.assert_close(state_c, new, atol=1e-5, rtol=1e-5)
            # rounded to bfloat16 at the same points: nearly every output is the same bfloat16 number, the
            # rest one unit of the last place apart (float32 sums in another order)
            equal = (got == want).float().mean().item()
            assert equal > 0.99, equal
            torch.testing.assert_close(got, want, atol=0.0, rtol=2 ** -7)


def test_a_bfloat16_decode_step_runs_the_c_step(model_dirs, monkeypatch):
    rt = ModelRuntime.load(model_dirs["qwen3_5"], dtype="bfloat16", device="cpu")
    ad = rt.adapter
    state = ad.new_state()
    model_thread.run(ad.forward, state, list(range(5, 30)))

    def refuse(*args, **kwargs):
        raise AssertionError("a decode step ran the PyTorch operations")

    monkeypatch.setattr(decode_layer, "gdn_between_products", refuse)
    logits = model_thread.run(lambda: [ad.forward_batch([state], [t]) for t in (3, 4)])
    ad.drop_batch()
    assert all(torch.isfinite(x).all() for x in logits)


def _greedy(rt, n=12):
    def run():
        ad = rt.adapter
        a, b = ad.new_state(), ad.new_state()
        ad.forward(a, list(range(5, 40)))
        logits = ad.forward(b, list(range(50, 61)))[None].repeat(2, 1)
        out = []
        for _ in range(n):  # two requests of different lengths decoding together
            ids = logits.argmax(-1).tolist()
            out.append(ids)
            logits = ad.forward_batch([a, b], ids)
        ad.drop_batch()
        return out

    return model_thread.run(run)


def test_greedy_tokens_with_and_without_the_c_step_are_the_same(model_dirs):
    rt = ModelRuntime.load(model_dirs["qwen3_5"], dtype="bfloat16", device="cpu")
    parts = _gdn_parts(rt)
    with_c = _greedy(rt)
    for p in parts:
        p.native = None
    assert _greedy(rt) == with_c


def test_a_wrong_build_is_refused_at_load(model_dirs, monkeypatch, tmp_path, fresh_library):
    """The same source with the state's decay left out: it builds and runs, and the load-time check refuses it."""
    source = native.SOURCE.read_text()
    wrong = source.replace("const float decay = expf(g);", "const float decay = 1.0f;")
    assert wrong != source
    (tmp_path / "gdn_step.c").write_text(wrong)
    monkeypatch.setattr(native, "SOURCE", tmp_path / "gdn_step.c")
    rt = ModelRuntime.load(model_dirs["qwen3_5"], dtype="bfloat16", device="cpu")
    assert rt.adapter.kernels.status["native_gdn_step"].startswith("off: max |diff|"), rt.adapter.kernels.status
    assert rt.adapter.kernels.on("decode_layer")  # the rest stays on
    assert all(p.native is None for p in _gdn_parts(rt))


@pytest.mark.parametrize("env,reason", [({"CC": "/nonexistent/cc"}, "off: the C compiler does not run"),
                                        ({"HYSERVE_NATIVE": "0"}, "off: disabled")])
def test_without_a_compiler_or_switched_off_the_pytorch_operations_run(model_dirs, monkeypatch, fresh_library,
                                                                        env, reason):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    rt = ModelRuntime.load(model_dirs["qwen3_5"], dtype="bfloat16", device="cpu")
    assert rt.adapter.kernels.status["native_gdn_step"].startswith(reason), rt.adapter.kernels.status
    assert rt.adapter.kernels.on("decode_layer")
    assert all(p.native is None for p in _gdn_parts(rt))


def test_float32_models_keep_the_pytorch_operations(runtimes):
    rt = runtimes("qwen3_5")
    assert "native_gdn_step" not in rt.adapter.kernels.status
    assert all(p.native is None for p in _gdn_parts(rt))

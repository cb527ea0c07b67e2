"""The C kernels of a bfloat16 decode step (`kernels.native`, `decode_step.c`): the few-row products, the
zero-centered norm, the Gated DeltaNet step and the decode attention give the results of what they replace, a
decode step runs them, each is checked at load (a wrong build is refused), and they are off without a compiler."""

from __future__ import annotations

import pytest
import torch

from hyserve import model_thread
from hyserve.kernels import attention, decode_layer, linear, native, norm, seam
from hyserve.models.runtime import ModelRuntime


@pytest.fixture
def fresh_library(monkeypatch, tmp_path):
    """Each load builds or refuses anew, into a cache folder of the test's own."""
    monkeypatch.setenv("HYSERVE_NATIVE_CACHE", str(tmp_path / "native"))
    native.library.cache_clear()
    yield
    native.library.cache_clear()


def _gdn_parts(rt):
    return [p for p in (m.__dict__.get(decode_layer.PARTS) for m in rt.model.modules()) if p and p.gdn is not None]


def _attention_layers(rt):
    return [m for m in rt.model.modules() if type(m).__name__.endswith("Attention") and hasattr(m, "q_proj")]


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
            torch.testing.assert_close(got, want, atol=0.0, rtol=2**-7)


def packs_bfloat16() -> bool:
    """Whether oneDNN packs bfloat16 weights on this CPU (not on one without AVX512, such as an AMD EPYC with
    AVX2 only): without packed weights there are no C products to take over their few-row products."""
    return linear.pack(torch.nn.Linear(64, 64, dtype=torch.bfloat16))


def _products(rt):
    weights = linear.every_packed(rt.model)
    if not weights and not packs_bfloat16():
        pytest.skip("oneDNN packs no bfloat16 weights on this CPU: the C products have nothing to take over")
    assert weights and all(w.native is not None for w in weights), rt.adapter.kernels.status
    return weights


def test_the_c_products_give_onednns_results(model_dirs):
    """Every packed weight of a bfloat16 model (the stacked siblings and the head among them), 1 to `ROWS` rows
    with a row stride of their own, and a width with 128-wide blocks and a ragged tail: oneDNN's bfloat16
    numbers on almost every output; a row's result is the same whatever batch it is in; more rows than `ROWS`
    are left to oneDNN."""
    rt = ModelRuntime.load(model_dirs["qwen3_5"], dtype="bfloat16", device="cpu")
    weights = _products(rt)
    products = weights[0].native
    g = torch.Generator().manual_seed(0)
    extra = linear.Packed((torch.randn(300, 1000, generator=g) * 0.05).to(torch.bfloat16))
    with torch.inference_mode():
        for w in [*weights, extra]:
            k = w.plain.shape[1]
            x = torch.randn(products.ROWS, 1, k + 7, generator=g).to(torch.bfloat16)[..., 3 : 3 + k]
            got = products(x, w.plain)
            _equal_bf16(got, linear.packed_product(x, w), at_least=0.98)
            for r in range(products.ROWS):
                assert torch.equal(products(x[r : r + 1], w.plain), got[r : r + 1])
            assert products(torch.zeros(products.ROWS + 1, 1, k, dtype=torch.bfloat16), w.plain) is None


def test_a_bfloat16_decode_step_runs_the_c_products(model_dirs):
    """With oneDNN's packed weights taken away, decode steps of one and of two requests still run."""
    rt = ModelRuntime.load(model_dirs["qwen3_5"], dtype="bfloat16", device="cpu")
    ad = rt.adapter
    a, b = ad.new_state(), ad.new_state()
    model_thread.run(ad.forward, a, list(range(5, 30)))
    model_thread.run(ad.forward, b, list(range(40, 50)))
    for w in _products(rt):
        w.onednn = None
    logits = model_thread.run(lambda: [ad.forward_batch([a], [3]), ad.forward_batch([a, b], [4, 5])])
    ad.drop_batch()
    assert all(torch.isfinite(x).all() for x in logits)


def _equal_bf16(got, want, at_least):
    """At least `at_least` of the numbers the same bfloat16, the rest within a unit or two of its last place."""
    assert got.shape == want.shape and got.dtype == want.dtype == torch.bfloat16
    equal = (got == want).float().mean().item()
    assert equal >= at_least, equal
    torch.testing.assert_close(got, want, atol=1e-3, rtol=2**-7)


@pytest.mark.parametrize("rows,keys", [(1, 1), (1, 5), (1, 300), (3, 700), (1, 5000)])
def test_the_c_decode_attention_is_as_close_to_exact_as_sdpa(model_dirs, rows, keys):
    """Against `decode_attention` (SDPA) and float64 on the model's attention shapes: KV with spare columns, rows
    left-padded, one key to several chunks of keys. Both round the softmax's numerators to bfloat16 at their own
    block boundaries, so they agree on most numbers, not all; each is within bfloat16 rounding of the exact."""
    rt = ModelRuntime.load(model_dirs["qwen3_5"], dtype="bfloat16", device="cpu")
    assert rt.adapter.kernels.on("native_attention"), rt.adapter.kernels.status
    layer = _attention_layers(rt)[0]
    kernel = layer.__dict__[attention.NATIVE]
    kv_heads, groups, dim = layer.config.num_key_value_heads, layer.num_key_value_groups, layer.head_dim
    g = torch.Generator().manual_seed(keys)
    q = torch.randn(rows, kv_heads * groups, 1, dim, generator=g).to(torch.bfloat16)
    k, v = (
        (torch.randn(rows, kv_heads, keys + 16, dim, generator=g) * 3).to(torch.bfloat16)[:, :, :keys] for _ in range(2)
    )
    mask = torch.ones(rows, 1, 1, keys, dtype=torch.bool)
    for r in range(1, rows):
        mask[r, ..., : 11 * r] = False
    for m in (mask, None):
        with torch.inference_mode():
            got = kernel(q, k, v, m, layer.scaling)
            want = attention.decode_attention(q, k, v, m, layer.scaling)
        scores = (q.double() @ k.double().repeat_interleave(groups, 1).transpose(-1, -2)) * layer.scaling
        if m is not None:
            scores = scores.masked_fill(~m, float("-inf"))
        exact = (scores.softmax(-1) @ v.double().repeat_interleave(groups, 1)).transpose(1, 2)
        scale = exact.abs().max().item()
        err_c, err_sdpa = ((x.double() - exact).abs().max().item() / scale for x in (got, want))
        assert got.shape == want.shape and got.dtype == torch.bfloat16
        assert err_c <= 1.25 * err_sdpa + 1e-3 and err_c < 2**-7, (err_c, err_sdpa)
        assert (got == want).float().mean().item() > 0.6


@pytest.mark.parametrize("groups,dim,keys", [(2, 64, 9), (3, 128, 301), (4, 256, 700), (5, 64, 64), (8, 128, 2)])
def test_the_c_decode_attention_takes_any_group_of_query_heads(groups, dim, keys):
    """Query heads per KV head four, two, then one at a time, keys two at a time (an odd count's last key alone):
    every split against float64, with a padded row."""
    lib, why = native.library()
    if lib is None:
        pytest.skip(why)
    kernel, rows, kv_heads = native.DecodeAttention(lib), 2, 2
    g = torch.Generator().manual_seed(groups * keys)
    q = torch.randn(rows, kv_heads * groups, 1, dim, generator=g).to(torch.bfloat16)
    k, v = ((torch.randn(rows, kv_heads, keys, dim, generator=g) * 3).to(torch.bfloat16) for _ in range(2))
    mask = torch.ones(rows, 1, 1, keys, dtype=torch.bool)
    mask[1, ..., : keys // 2] = False
    with torch.inference_mode():
        got = kernel(q, k, v, mask, dim**-0.5)
    scores = (q.double() @ k.double().repeat_interleave(groups, 1).transpose(-1, -2)) * dim**-0.5
    exact = (scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v.double().repeat_interleave(groups, 1)).transpose(
        1, 2
    )
    assert got is not None and got.shape == exact.shape
    assert (got.double() - exact).abs().max().item() / exact.abs().max().item() < 2**-7


def test_a_bfloat16_decode_step_runs_the_c_step(model_dirs, monkeypatch):
    rt = ModelRuntime.load(model_dirs["qwen3_5"], dtype="bfloat16", device="cpu")
    ad = rt.adapter
    state = ad.new_state()
    model_thread.run(ad.forward, state, list(range(5, 30)))

    def refuse(*args, **kwargs):
        raise AssertionError("a decode step ran the PyTorch operations")

    monkeypatch.setattr(decode_layer, "gdn_between_products", refuse)
    monkeypatch.setattr(attention, "decode_attention", refuse)
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


def test_greedy_tokens_with_and_without_the_c_kernels_are_the_same(model_dirs):
    rt = ModelRuntime.load(model_dirs["qwen3_5"], dtype="bfloat16", device="cpu")
    parts = _gdn_parts(rt)
    with_c = _greedy(rt)
    for p in parts:
        p.native = None
    attention.uninstall_native(rt.model)
    for w in linear.every_packed(rt.model):  # (none where oneDNN packs no bfloat16 weights)
        w.native = None
    norm.uninstall_native(rt.model)
    assert _greedy(rt) == with_c


def _norms(rt):
    return [m for m in rt.model.modules() if getattr(m.__dict__.get("forward"), "form", None) is norm.zero_centered]


def test_the_c_norm_gives_the_pytorch_operations_results(model_dirs):
    """Every zero-centered norm of a Qwen3.5 model runs it, for 1 to ROWS rows of a stride of their own, with the
    PyTorch form's numbers but for a rare last-place rounding of bfloat16 (its mean is summed in another order); a
    row's result is the same in any batch; more rows are left to PyTorch."""
    rt = ModelRuntime.load(model_dirs["qwen3_5"], dtype="bfloat16", device="cpu")
    assert rt.adapter.kernels.on("native_norm"), rt.adapter.kernels.status
    norms = _norms(rt)
    assert norms and all(norm.NATIVE in m.__dict__ for m in norms)
    g = torch.Generator().manual_seed(1)

    def run():
        for m in norms:
            c = m.__dict__[norm.NATIVE]
            width = m.weight.shape[-1]
            x = (torch.randn(c.ROWS, 1, width + 5, generator=g) * 4).to(torch.bfloat16)[..., 2 : 2 + width]
            got = m(x)
            with seam.reference_only():
                want = m(x)
            assert got.dtype == torch.bfloat16 and got.shape == want.shape
            torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
            assert (got == want).float().mean() > 0.99
            assert all(torch.equal(c(x[r : r + 1]), got[r : r + 1]) for r in range(c.ROWS))
            assert c(torch.zeros(c.ROWS + 1, 1, width, dtype=torch.bfloat16)) is None

    with torch.inference_mode():
        model_thread.run(run)


@pytest.mark.parametrize(
    "kernel,right,wrong",
    [
        ("native_gdn_step", "const float decay = expf(g);", "const float decay = 1.0f;"),  # the state's decay left out
        (
            "native_norm",
            "const float inv = 1.0f / sqrtf((float)(sum / n) + eps);",  # epsilon taken as 0.5
            "const float inv = 1.0f / sqrtf((float)(sum / n) + 0.5f);",
        ),
        (
            "native_attention",
            "scores[i][s + t] = open ? (t ? d1[i] : d0[i]) * a->scale : -INFINITY;",  # the scores left unscaled
            "scores[i][s + t] = open ? (t ? d1[i] : d0[i]) : -INFINITY;",
        ),
        (
            "native_linear",
            "to_bf(dot_bf16(w + j * (long)k, x + r * x_stride, k))",  # each row's product with the next row
            "to_bf(dot_bf16(w + (j + 1 < n ? j + 1 : j) * (long)k, x + r * x_stride, k))",
        ),
    ],
)
def test_a_wrong_build_is_refused_at_load(model_dirs, monkeypatch, tmp_path, fresh_library, kernel, right, wrong):
    """The source with one mistake builds and runs, and the load-time check refuses that kernel."""
    if kernel == "native_linear" and not packs_bfloat16():
        pytest.skip("oneDNN packs no bfloat16 weights on this CPU: the C products are never checked")
    source = native.SOURCE.read_text()
    assert right in source
    (tmp_path / "decode_step.c").write_text(source.replace(right, wrong))
    monkeypatch.setattr(native, "SOURCE", tmp_path / "decode_step.c")
    rt = ModelRuntime.load(model_dirs["qwen3_5"], dtype="bfloat16", device="cpu")
    status = rt.adapter.kernels.status
    assert status[kernel].startswith("off: max |diff|"), status
    assert rt.adapter.kernels.on("decode_layer") and rt.adapter.kernels.on("attention")  # the rest stays on
    others = ("native_gdn_step", "native_attention", "native_norm") + (("native_linear",) if packs_bfloat16() else ())
    assert all(rt.adapter.kernels.on(other) for other in others if other != kernel)
    assert all((norm.NATIVE in m.__dict__) == (kernel != "native_norm") for m in _norms(rt))
    assert all((p.native is None) == (kernel == "native_gdn_step") for p in _gdn_parts(rt))
    assert all((attention.NATIVE in m.__dict__) == (kernel != "native_attention") for m in _attention_layers(rt))
    assert all((w.native is None) == (kernel == "native_linear") for w in linear.every_packed(rt.model))


@pytest.mark.parametrize(
    "env,reason",
    [({"CC": "/nonexistent/cc"}, "off: the C compiler does not run"), ({"HYSERVE_NATIVE": "0"}, "off: disabled")],
)
def test_without_a_compiler_or_switched_off_the_pytorch_operations_run(
    model_dirs, monkeypatch, fresh_library, env, reason
):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    rt = ModelRuntime.load(model_dirs["qwen3_5"], dtype="bfloat16", device="cpu")
    assert rt.adapter.kernels.status["native_gdn_step"].startswith(reason), rt.adapter.kernels.status
    assert rt.adapter.kernels.status["native_attention"].startswith(reason), rt.adapter.kernels.status
    assert rt.adapter.kernels.status["native_linear"].startswith(reason), rt.adapter.kernels.status
    assert rt.adapter.kernels.status["native_norm"].startswith(reason), rt.adapter.kernels.status
    assert not any(norm.NATIVE in m.__dict__ for m in _norms(rt))
    assert rt.adapter.kernels.on("decode_layer") and rt.adapter.kernels.on("attention")
    assert all(w.native is None for w in linear.every_packed(rt.model)) and rt.adapter.kernels.on("linear")
    assert all(p.native is None for p in _gdn_parts(rt))
    assert not any(attention.NATIVE in m.__dict__ for m in _attention_layers(rt))


def test_float32_models_keep_the_pytorch_operations(runtimes):
    rt = runtimes("qwen3_5")
    assert not {"native_gdn_step", "native_attention", "native_linear", "native_norm"} & set(rt.adapter.kernels.status)
    assert not any(attention.NATIVE in m.__dict__ for m in _attention_layers(rt))
    assert all(p.native is None for p in _gdn_parts(rt))

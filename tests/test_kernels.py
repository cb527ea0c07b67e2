"""hyserve's kernels against the transformers reference functions they stand in for."""

import threading

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.models.qwen3_5 import modeling_qwen3_5

from hyserve import kernels, model_thread


class _Attn(torch.nn.Module):
    num_key_value_groups = 4
    is_causal = True


def _reference(name: str):
    """transformers' own function `name` of the qwen3_5 module (hooked only where transformers has no slots)."""
    fn = getattr(modeling_qwen3_5, name)
    return getattr(fn, "reference", fn)


def _reference_recurrent():
    return _reference("torch_recurrent_gated_delta_rule")


def _deltanet_inputs(b, hk, h, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return dict(
        query=r(b, 1, hk, d),
        key=r(b, 1, hk, d),
        value=r(b, 1, h, d),
        g=-torch.rand(b, 1, h, generator=g) * 3,
        beta=torch.rand(b, 1, h, generator=g),
        initial_state=r(b, h, d, d) * 0.3,
    )


@pytest.mark.parametrize("b,hk,h,d", [(1, 2, 4, 16), (5, 4, 8, 64), (3, 2, 2, 8)])
def test_recurrent_step_equals_the_reference_and_updates_the_state_in_place(b, hk, h, d):
    x = _deltanet_inputs(b, hk, h, d)
    state_in = x["initial_state"]
    want_out, want_state = _reference_recurrent()(**x, output_final_state=True, use_qk_l2norm_in_kernel=True)
    out, state = kernels.recurrent_step(**x, output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert out.shape == want_out.shape and state.shape == want_state.shape
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, want_state, rtol=1e-5, atol=1e-5)
    assert state is state_in  # the cache's own tensor, as transformers' cache would have overwritten it
    x["initial_state"] = want_state + 1.0  # a different state must give a different answer
    other, _ = kernels.recurrent_step(**x, use_qk_l2norm_in_kernel=True)
    assert not torch.allclose(other, out)


def test_recurrent_step_leaves_a_state_it_cannot_update_in_place_alone():
    x = _deltanet_inputs(2, 2, 4, 16)
    x["initial_state"] = x["initial_state"].transpose(-1, -2).contiguous().transpose(-1, -2)  # not contiguous
    before = x["initial_state"].clone()
    want_out, want_state = _reference_recurrent()(**x, output_final_state=True, use_qk_l2norm_in_kernel=True)
    out, state = kernels.recurrent_step(**x, output_final_state=True, use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, want_state, rtol=1e-5, atol=1e-5)
    assert torch.equal(x["initial_state"], before)


def _reference_conv():
    return _reference("causal_conv1d_update")


@pytest.mark.parametrize("b,state_len,bias,activation", [(1, 4, True, "silu"), (5, 4, False, None), (3, 6, True, None)])
def test_conv_step_equals_the_reference(b, state_len, bias, activation):
    g = torch.Generator().manual_seed(1)
    channels, kernel = 24, 4
    x = torch.randn(b, channels, 1, generator=g)
    state = torch.randn(b, channels, state_len, generator=g)
    weight = torch.randn(channels, kernel, generator=g)
    bias_t = torch.randn(channels, generator=g) if bias else None
    want_state = state.clone()
    want = _reference_conv()(x, want_state, weight, bias_t, activation)
    got = kernels.conv_step(x, state, weight, bias_t, activation)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(state, want_state)  # the shifted window, in place, as the reference leaves it
    assert not torch.allclose(kernels.conv_step(x, state, weight, bias_t, activation), want)  # a new column


def test_conv_step_in_bfloat16_equals_the_reference_bit_for_bit():
    """bfloat16 weights: the taps are summed in float32 and rounded once, as the reference's grouped conv does."""
    g = torch.Generator().manual_seed(2)
    channels, kernel = 512, 4
    x = torch.randn(2, channels, 1, generator=g).bfloat16()
    state = torch.randn(2, channels, kernel, generator=g).bfloat16()
    weight = torch.randn(channels, kernel, generator=g).bfloat16()
    bias = torch.randn(channels, generator=g).bfloat16()
    want_state = state.clone()
    want = _reference_conv()(x, want_state, weight, bias, "silu")
    got = kernels.conv_step(x, state, weight, bias, "silu")
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, want)
    assert torch.equal(state, want_state)


def _attention_inputs(q_len, kv_len, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, q_len, 8, 16, generator=g).transpose(1, 2)  # a transposed view, as the models pass it
    k, v = torch.randn(2, 2, kv_len, 16, generator=g), torch.randn(2, 2, kv_len, 16, generator=g)
    mask = torch.ones(q_len, kv_len, dtype=torch.bool).tril(kv_len - q_len)[None, None].repeat(2, 1, 1, 1)
    mask[1, :, :, :3] = False  # left padding in the second row
    return q, k, v, mask


@pytest.mark.parametrize("q_len,kv_len", [(7, 40), (33, 33), (64, 300)])
def test_gqa_attention_is_bit_identical_to_transformers_sdpa(q_len, kv_len):
    q, k, v, mask = _attention_inputs(q_len, kv_len)
    want, _ = sdpa_attention_forward(_Attn(), q, k, v, mask, scaling=0.25)
    got, _ = model_thread.run(kernels.gqa_sdpa_attention, _Attn(), q, k, v, mask, scaling=0.25)
    assert got.shape == want.shape and torch.equal(got, want)
    wrong, _ = model_thread.run(
        kernels.gqa_sdpa_attention, _Attn(), q, k, v, ~mask | torch.eye(q_len, kv_len, dtype=torch.bool), scaling=0.25
    )
    assert not torch.allclose(wrong, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,kv_len,masked", [(1, 40, False), (3, 40, True), (8, 541, True)])
def test_decode_attention_equals_sdpa_over_repeated_kv_heads(dtype, rows, kv_len, masked):
    """A decode step's grouped queries in one SDPA call per KV head: SDPA over KV heads repeated for their queries
    (transformers' layout), bit for bit in bfloat16, with left padding masked per row; a wrong mask changes it."""
    g = torch.Generator().manual_seed(rows)
    q = torch.randn(rows, 1, 8, 16, generator=g).transpose(1, 2).to(dtype)
    k, v = (torch.randn(rows, 2, kv_len, 16, generator=g).to(dtype) for _ in range(2))
    mask = None
    if masked:
        mask = torch.ones(rows, 1, 1, kv_len, dtype=torch.bool)
        for r in range(rows):
            mask[r, ..., : 3 * r] = False
    got, _ = model_thread.run(kernels.gqa_sdpa_attention, _Attn(), q, k, v, mask, scaling=0.25)
    repeated = [t.repeat_interleave(4, dim=1) for t in (k, v)]
    want = torch.nn.functional.scaled_dot_product_attention(q, *repeated, attn_mask=mask, scale=0.25)
    want = want.transpose(1, 2)
    assert got.shape == (rows, 1, 8, 16)
    if dtype == torch.bfloat16:
        assert torch.equal(got, want)
    else:  # float32: the flash kernel's rounding depends on how many queries it is handed, within a unit or two
        assert torch.allclose(got, want, atol=1e-6, rtol=0)
    reference, _ = sdpa_attention_forward(_Attn(), q, k, v, mask, scaling=0.25)  # transformers' own call
    assert torch.allclose(got.float(), reference.float(), atol=1e-2 if dtype == torch.bfloat16 else 1e-5)
    if masked:
        wrong, _ = model_thread.run(kernels.gqa_sdpa_attention, _Attn(), q, k, v, ~mask, scaling=0.25)
        assert not torch.allclose(wrong.float(), want.float(), atol=1e-2)


@pytest.mark.parametrize("q_len,prefix", [(1, 1500), (79, 4121), (5, 1100)])
def test_short_queries_over_a_long_cache_take_grouped_products_and_match_sdpa(q_len, prefix):
    g = torch.Generator().manual_seed(q_len)
    kv_len = prefix + q_len
    q = torch.randn(1, q_len, 8, 16, generator=g).transpose(1, 2)
    k, v = torch.randn(1, 2, kv_len, 16, generator=g), torch.randn(1, 2, kv_len, 16, generator=g)
    mask = torch.ones(q_len, kv_len, dtype=torch.bool).tril(prefix)[None, None]
    assert kernels.attention._short_over_long(q, k, mask)
    want, _ = sdpa_attention_forward(_Attn(), q, k, v, mask, scaling=0.25)
    got, _ = model_thread.run(kernels.gqa_sdpa_attention, _Attn(), q, k, v, mask, scaling=0.25)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # the scores live in a buffer reused by the next call: a result never aliases it
    smaller = kernels.grouped_attention(q[:, :, :1], k[:, :, :1100], v[:, :, :1100], mask[..., :1, :1100], 0.25)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert smaller.shape == (1, 8, 1, 16)
    # each query head reads its own group's keys: a group order mix-up or a dropped mask is caught
    swapped = torch.cat([k[:, 1:], k[:, :1]], dim=1)
    assert not torch.allclose(kernels.grouped_attention(q, swapped, v, mask, 0.25).transpose(1, 2), want, atol=1e-3)
    if q_len > 1:
        open_mask = torch.ones_like(mask)
        assert not torch.allclose(kernels.grouped_attention(q, k, v, open_mask, 0.25).transpose(1, 2), want, atol=1e-3)


def test_long_pieces_and_batches_keep_sdpa():
    q, k = torch.zeros(1, 8, 512, 16), torch.zeros(1, 2, 4600, 16)
    mask = torch.ones(1, 1, 512, 4600, dtype=torch.bool)
    assert not kernels.attention._short_over_long(q, k, mask)  # a long piece (its scores would not fit in cache either)
    assert not kernels.attention._short_over_long(q[:, :, :129], k[:, :, :1100], mask[..., :129, :1100])
    assert not kernels.attention._short_over_long(q[:, :, :8], k[:, :, :600], mask[..., :8, :600])  # a short cache
    assert not kernels.attention._short_over_long(q[:, :, :8].expand(2, -1, -1, -1), k, mask[..., :8, :])  # a batch


def _slot(service, name: str):
    """The function the first Gated DeltaNet (or Mamba2) layer calls for `name`, hooked by hyserve: its own slot,
    or the module-level function where this transformers has no slots."""
    from hyserve.kernels import FUNCTIONS
    from hyserve.kernels.seam import global_sites, slots

    found = slots(service.runtime.model, name)
    if found:
        return found[0][1]
    kernel = next(k for k in FUNCTIONS if k.name == name)
    return getattr(global_sites(service.runtime.model, kernel)[0][1], kernel.legacy)


def test_kernels_apply_on_the_model_thread_only(make_service, monkeypatch):
    svc = make_service("qwen3_5")  # loading a model hooks the kernels that pass the load-time check
    fn = _slot(svc, "fused_recurrent_gated_delta_rule")
    x = _deltanet_inputs(2, 2, 4, 16)
    ref = _reference_recurrent()(**x, output_final_state=True, use_qk_l2norm_in_kernel=True)
    off_thread = []
    t = threading.Thread(
        target=lambda: off_thread.append(fn(**x, output_final_state=True, use_qk_l2norm_in_kernel=True))
    )
    t.start()
    t.join()
    assert all(torch.equal(a, b) for a, b in zip(off_thread[0], ref))  # elsewhere: transformers itself
    calls = []
    real = kernels.delta_rule.recurrent_step
    monkeypatch.setattr(kernels.delta_rule, "recurrent_step", lambda *a, **k: calls.append(1) or real(*a, **k))
    model_thread.run(fn, **x, output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert calls == [1]

    def reference_run():
        with kernels.reference_only():  # the load-time check's baseline
            return fn(**x, output_final_state=True, use_qk_l2norm_in_kernel=True)

    model_thread.run(reference_run)
    assert calls == [1]


@pytest.mark.parametrize("rows,bias", [(1, True), (16, False), (16, True), (40, True), (100, False)])
def test_linear_forward_matches_nn_linear(rows, bias):
    torch.manual_seed(0)
    lin = torch.nn.Linear(96, 160, bias=bias)
    x = torch.randn(rows, 1, 96)
    want = lin(x)
    got = model_thread.run(kernels.linear_forward, lin, x)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # a transposed view for skinny inputs: the models' reshapes (split heads, merge rows) must still work
    torch.testing.assert_close(got.view(rows, 1, 10, 16), want.view(rows, 1, 10, 16))
    torch.testing.assert_close(got.view(-1, 160), want.view(-1, 160))
    assert not torch.allclose(model_thread.run(kernels.linear_forward, lin, x + 1), want)


def _reference_chunked():
    return _reference("torch_chunk_gated_delta_rule")


@pytest.mark.parametrize("length", [1, 15, 79, 97, 150])
def test_fitted_chunks_equal_transformers_64_token_chunks(length):
    g = torch.Generator().manual_seed(length)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    x = dict(
        query=r(1, length, 2, 16),
        key=r(1, length, 2, 16),
        value=r(1, length, 4, 16),
        g=-torch.rand(1, length, 4, generator=g),
        beta=torch.rand(1, length, 4, generator=g),
        initial_state=r(1, 4, 16, 16) * 0.3,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    chunk = kernels.chunk_size_for(length)
    assert chunk == length if length <= 96 else chunk in (32, 64)
    want_out, want_state = _reference_chunked()(**x)
    out, state = model_thread.run(_reference_chunked(), **x, chunk_size=chunk)
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, want_state, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "length,chunk,hk,decay",
    [(1, 16, 2, 1.0), (79, 80, 2, 1.0), (79, 80, 4, 40.0), (150, 32, 2, 40.0), (200, 64, 4, 3.0)],
)
def test_chunked_delta_rule_equals_the_reference(length, chunk, hk, decay):
    """Including decays strong enough that exp underflows inside a chunk (where `safe_exp` returns 0)."""
    g = torch.Generator().manual_seed(length)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    x = dict(
        query=r(1, length, hk, 16),
        key=r(1, length, hk, 16),
        value=r(1, length, 4, 16),
        g=-torch.rand(1, length, 4, generator=g) * decay,
        beta=torch.rand(1, length, 4, generator=g),
        initial_state=r(1, 4, 16, 16) * 0.3,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    want_out, want_state = model_thread.run(_reference_chunked(), **x, chunk_size=chunk)
    out, state = model_thread.run(kernels.chunked_delta_rule, **x, chunk_size=chunk)
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, want_state, rtol=1e-5, atol=1e-5)
    x["g"] = x["g"] * 0.5
    assert not torch.allclose(model_thread.run(kernels.chunked_delta_rule, **x, chunk_size=chunk)[1], want_state)


def test_chunked_delta_rule_without_a_state_starts_from_zero():
    g = torch.Generator().manual_seed(1)
    x = dict(
        query=torch.randn(1, 40, 2, 16, generator=g),
        key=torch.randn(1, 40, 2, 16, generator=g),
        value=torch.randn(1, 40, 2, 16, generator=g),
        g=-torch.rand(1, 40, 2, generator=g),
        beta=torch.rand(1, 40, 2, generator=g),
    )
    out, state = kernels.chunked_delta_rule(**x, chunk_size=16)
    want, _ = _reference_chunked()(**x, chunk_size=16)
    assert state is None
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


def test_safe_exp_is_exp_above_the_floor_and_zero_below():
    x = torch.tensor([0.0, -1.0, -50.0, -86.9, -87.5, -200.0, float("-inf")])
    got = kernels.safe_exp(x)
    assert torch.equal(got[:4], x[:4].exp())
    assert torch.equal(got[4:], torch.zeros(3))
    assert torch.equal(x, torch.tensor([0.0, -1.0, -50.0, -86.9, -87.5, -200.0, float("-inf")]))  # input untouched


def test_the_model_thread_runs_fitted_chunks(make_service, monkeypatch):
    svc = make_service("qwen3_5")  # loading a model installs the kernels
    fn = _slot(svc, "chunk_gated_delta_rule")
    reference = _reference("torch_chunk_gated_delta_rule")
    g = torch.Generator().manual_seed(3)
    x = dict(
        query=torch.randn(1, 20, 2, 16, generator=g),
        key=torch.randn(1, 20, 2, 16, generator=g),
        value=torch.randn(1, 20, 4, 16, generator=g),
        g=-torch.rand(1, 20, 4, generator=g),
        beta=torch.rand(1, 20, 4, generator=g),
        use_qk_l2norm_in_kernel=True,
    )
    seen = []
    monkeypatch.setattr(kernels.delta_rule, "chunk_size_for", lambda n: seen.append(n) or 16)
    fn(**x)  # another thread: transformers' own 64-token chunks
    assert seen == []
    out, _ = model_thread.run(fn, **x)
    assert seen == [20]
    torch.testing.assert_close(out, reference(**x, chunk_size=16)[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "length,bias,activation", [(1, True, "silu"), (7, False, None), (83, True, None), (300, False, "silu")]
)
def test_conv_prefill_equals_the_reference(length, bias, activation):
    g = torch.Generator().manual_seed(length)
    x = torch.randn(2, 24, length, generator=g)
    weight = torch.randn(24, 4, generator=g)
    bias_t = torch.randn(24, generator=g) if bias else None
    want = _reference("causal_conv1d_fn")(x, weight, bias_t, activation)
    got = kernels.conv_prefill(x, weight, bias_t, activation)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(kernels.conv_prefill(x + 1, weight, bias_t, activation), want)


def test_mamba2_takes_the_conv_kernels(make_service):
    svc = make_service("mamba2")
    for name in ("causal_conv1d_fn", "causal_conv1d_update"):
        assert svc.runtime.adapter.kernels.on(name), svc.runtime.adapter.kernels.status
        hooked = _slot(svc, name)
        assert hasattr(getattr(hooked, "forward", hooked), "reference"), name


def test_sibling_projections_run_as_one_stacked_product_with_the_same_results(model_dirs):
    """bfloat16 qwen3_5: each Gated DeltaNet layer's four input projections, attention's q/k/v and the MLP's
    gate/up run as one stacked product per group; decode logits are bit for bit those of the layers apart,
    a member called on another input computes its own product, and the members' own packed copies are freed."""
    from hyserve.kernels import linear
    from hyserve.models.runtime import ModelRuntime

    rt = ModelRuntime.load(model_dirs["qwen3_5"], dtype="bfloat16", device="cpu")
    grouped = [m for m in rt.model.modules() if linear.GROUP in m.__dict__]
    if not grouped:
        pytest.skip("no oneDNN bfloat16 products on this CPU")
    names = {n.rsplit(".", 1)[-1] for n, m in rt.model.named_modules() if linear.GROUP in m.__dict__}
    assert {
        "in_proj_qkv",
        "in_proj_z",
        "in_proj_b",
        "in_proj_a",
        "gate_proj",
        "up_proj",
        "q_proj",
        "k_proj",
        "v_proj",
    } <= names
    assert not any(linear.PACKED in m.__dict__ for m in grouped)
    ad = rt.adapter

    def decode_logits():
        states = [ad.new_state(), ad.new_state()]
        ad.forward(states[0], list(range(5, 40)))
        ad.forward(states[1], list(range(50, 61)))
        out = [ad.forward_batch(states, [7, 9]) for _ in range(3)]
        ad.drop_batch()
        return torch.stack(out)

    with_groups = model_thread.run(decode_logits)
    saved = {id(m): m.__dict__.pop(linear.GROUP) for m in grouped}
    for m in grouped:  # apart: each member's own packed product (the C one where the group has it)
        linear.pack(m)
        m.__dict__[linear.PACKED].native = saved[id(m)].packed.native
    apart = model_thread.run(decode_logits)
    for m in grouped:
        m.__dict__[linear.GROUP] = saved[id(m)]
    assert torch.equal(with_groups, apart)

    layer = next(m for n, m in rt.model.named_modules() if n.endswith("mlp"))
    x, y = (
        torch.randn(1, 1, layer.gate_proj.in_features, generator=torch.Generator().manual_seed(s)).bfloat16()
        for s in (0, 1)
    )

    def mixed():
        return layer.gate_proj(x), layer.up_proj(y)

    gate, up = model_thread.run(mixed)
    assert torch.equal(gate, torch.nn.functional.linear(x, layer.gate_proj.weight))
    assert torch.equal(up, torch.nn.functional.linear(y, layer.up_proj.weight))


def _norms():
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    return {
        modeling_qwen3_5.Qwen3_5RMSNorm: "zero_centered",
        modeling_qwen3_5.Qwen3_5RMSNormGated: "gated",
        Qwen3RMSNorm: "weight_after_cast",
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_norm_class_takes_the_form_that_equals_its_own_forward_bit_for_bit(dtype):
    from hyserve.kernels import norm

    g = torch.Generator().manual_seed(3)
    for cls, name in _norms().items():
        module = cls(96, eps=1e-6).to(dtype)
        with torch.no_grad():
            module.weight.copy_(torch.randn(96, generator=g))
        form = norm.matching_form(module, dtype)
        assert form is not None and form.__name__ == name
        norm._prepare(module, form)
        x = (torch.randn(3, 5, 96, generator=g) * 4).to(dtype)  # other shapes than the load-time probes
        args = (x, torch.randn(3, 5, 96, generator=g).to(dtype)) if form is norm.gated else (x,)
        assert torch.equal(form(module, *args), cls.forward(module, *args))


def test_a_norm_no_form_reproduces_keeps_its_own_forward():
    from hyserve.kernels import norm

    class ShiftedRMSNorm(modeling_qwen3_5.Qwen3_5RMSNorm):
        def forward(self, x):
            return super().forward(x) + 1e-3

    assert norm.matching_form(ShiftedRMSNorm(64), torch.float32) is None


def test_the_model_thread_runs_the_norm_forms(make_service):
    """The served tiny qwen3_5 has every norm on a form, and its logits equal transformers' own norms'."""
    from hyserve.kernels import norm

    rt = make_service("qwen3_5").runtime
    assert rt.kernels.on("norm")
    forms = {
        type(m).__name__: m.forward.form.__name__
        for m in rt.model.modules()
        if getattr(m.__dict__.get("forward"), "form", None) is not None
    }
    assert forms == {"Qwen3_5RMSNorm": "zero_centered", "Qwen3_5RMSNormGated": "gated"}

    def logits():
        ad = rt.adapter
        return ad.forward(ad.new_state(), list(range(3, 40)), all_logits=True)

    got = model_thread.run(logits)
    model_thread.run(norm.uninstall, rt.model)
    try:
        want = model_thread.run(logits)
    finally:
        model_thread.run(norm.install, rt.model, rt.model.dtype)
    assert torch.equal(got, want)

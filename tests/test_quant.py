"""`--quantization int8|int4`: weights held once as GGUF Q8_0 / Q4_0 blocks, the C products of a decode step's few
rows checked at load (a wrong build is refused), and the standards every dtype keeps: cache on == cache off token
for token for every family, a batched decode step == each row decoded alone."""

from __future__ import annotations

import logging
import math
import struct

import pytest
import torch

from hyserve import model_thread, quant
from hyserve.kernels import linear
from hyserve.models.runtime import ModelRuntime
from hyserve.quant import experts as qexperts
from hyserve.quant import layout
from hyserve.quant import native as qnative
from hyserve.quant import siblings as qsiblings
from hyserve.testing.tiny import ARCHS

from .conftest import FAMILIES
from .test_engine_cache import SCRIPT, run_chat

# The families whose MoE blocks hold transformers' fused 3-D expert weights (qwen3_next is among FAMILIES).
MOE = ("qwen3_5_moe", "nemotron_h", "granitemoehybrid", "lfm2_moe", "jamba")
# The other hybrid families.
OTHERS = tuple(a for a in ARCHS if a not in FAMILIES + MOE)


@pytest.fixture(scope="module")
def quantized(model_dirs):
    """get(arch, dtype, scheme): a runtime of the tiny `arch` with quantized weights, loaded once per module."""
    loaded = {}

    def get(arch: str, dtype: str = "float32", scheme: str = "int8") -> ModelRuntime:
        if (arch, dtype, scheme) not in loaded:
            loaded[arch, dtype, scheme] = ModelRuntime.load(
                model_dirs[arch], dtype=dtype, device="cpu", quantization=scheme
            )
        return loaded[arch, dtype, scheme]

    return get


@pytest.fixture
def fresh_library(monkeypatch, tmp_path):
    """Each load builds or refuses anew, into a cache folder of the test's own."""
    monkeypatch.setenv("HYSERVE_NATIVE_CACHE", str(tmp_path / "native"))
    qnative.library.cache_clear()
    yield
    qnative.library.cache_clear()


def _q8_0_blocks(w: torch.Tensor) -> bytes:
    """ggml's quantize_row_q8_0_ref: per 32 weights d = amax / 127 and roundf(w * (1 / d)) in float32 (halves away
    from zero), written as GGUF does: d as float16, then the 32 int8."""
    out = b""
    for block in w.float().reshape(-1, 32):
        d = block.abs().max() / 127
        x = (block * (1 / d if d else torch.zeros(()))).tolist()
        q = [int(math.copysign(math.floor(abs(v) + 0.5), v)) for v in x]
        out += struct.pack("<e", d.item()) + struct.pack("32b", *q)
    return out


def test_the_layout_holds_q8_0_blocks_as_they_are():
    """A GGUF Q8_0 block is 2 bytes of float16 scale then 32 int8: split into `d` and `qs` they are the layout's
    own tensors; what `quantize` makes of a weight is byte for byte what ggml makes, and dequantizes within half
    a step (plus the scale's float16 rounding)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(6, 96, generator=g) * 0.05
    w[2, :32] = 0  # an all-zero block: scale 0, values 0
    blocks = torch.frombuffer(bytearray(_q8_0_blocks(w)), dtype=torch.uint8).reshape(-1, 34)
    d = blocks[:, :2].clone().view(torch.float16).reshape(6, 3)
    qs = blocks[:, 2:].clone().view(torch.int8).reshape(6, 96)
    got_qs, got_d = layout.quantize(w)
    assert got_d.dtype == torch.float16 and got_qs.dtype == torch.int8
    assert torch.equal(got_d, d)
    assert torch.equal(got_qs, qs)
    tie = torch.zeros(1, 32)
    tie[0, :5] = torch.tensor([127.0, 0.5, -0.5, 2.5, -2.5])  # d = 1: halves go away from zero, as roundf
    assert layout.quantize(tie)[0][0, :5].tolist() == [127, 1, -1, 3, -3]
    back = layout.dequantize(qs, d, torch.float32)
    assert torch.all((back - w).abs()[1:] <= d.float().repeat_interleave(32, 1)[1:] * 0.6)
    assert torch.equal(back[2, :32], torch.zeros(32))


def _q4_0_blocks(w: torch.Tensor) -> bytes:
    """ggml's quantize_row_q4_0_ref: per 32 weights d = (the weight of largest magnitude) / -8, u = min(15,
    (int8_t)(w * (1 / d) + 8.5f)) in float32, weight i in the low nibble of byte i, weight 16 + i in its high one."""
    out = b""
    for block in w.float().reshape(-1, 32):
        top = block[int(block.abs().argmax())]
        d = top / -8
        u = ((block * (1 / d if d else torch.zeros(()))) + 8.5).tolist()  # float32 operations, as ggml's
        u = [min(15, int(v)) for v in u]
        out += struct.pack("<e", d.item()) + bytes(u[i] | (u[16 + i] << 4) for i in range(16))
    return out


def test_the_layout_holds_q4_0_blocks_as_they_are():
    """A GGUF Q4_0 block is 2 bytes of float16 scale then 16 bytes of nibbles: split into `d` and `qs`, the
    layout's own tensors, byte for byte what `quantize` makes; dequantized within half a step (a whole one
    where Q4_0 clamps)."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(5, 64, generator=g) * 0.05
    w[1, 32:] = 0
    blocks = torch.frombuffer(bytearray(_q4_0_blocks(w)), dtype=torch.uint8).reshape(-1, 18)
    d = blocks[:, :2].clone().view(torch.float16).reshape(5, 2)
    qs = blocks[:, 2:].clone().reshape(5, 32)
    got_qs, got_d = layout.quantize(w, "int4")
    assert got_qs.dtype == torch.uint8 and torch.equal(got_qs, qs) and torch.equal(got_d, d)
    back = layout.dequantize(qs, d, torch.float32)
    step = d.float().abs().repeat_interleave(32, 1)
    err = (back - w).abs()
    assert torch.all(err <= step + 1e-6)  # a full step where +8 steps clamp to +7, as in Q4_0
    assert (err <= step * 0.51 + 1e-6).float().mean() > 0.95
    assert torch.equal(back[1, 32:], torch.zeros(32))
    one = torch.zeros(1, 32)
    one[0, 0], one[0, 17] = -8.0, 3.0  # d = 1: u = w + 8 (the high nibble of byte 1 holds weight 17)
    qs1, d1 = layout.quantize(one, "int4")
    assert d1.item() == 1.0 and qs1[0, 0].item() == 0 | (8 << 4) and qs1[0, 1].item() == 8 | (11 << 4)


def _q6_0_blocks(w: torch.Tensor) -> bytes:
    """ik_llama.cpp's quantize_row_q6_0_ref for the values: per 32 weights d = (the weight of largest magnitude)
    / -32, u = min(63, (int8_t)(w * (1 / d) + 32.5f)) in float32; then d and the 24 bytes as layout.py lays them out:
    byte i < 16 is u[i] | (u[16 + i] >> 4) << 6, byte 16 + j is (u[16 + j] & 15) | (u[24 + j] & 15) << 4."""
    out = b""
    for block in w.float().reshape(-1, 32):
        d = block[int(block.abs().argmax())] / -32
        u = [min(63, int(v)) for v in ((block * (1 / d if d else torch.zeros(()))) + 32.5).tolist()]
        first = bytes(u[i] | (u[16 + i] >> 4) << 6 for i in range(16))
        out += struct.pack("<e", d.item()) + first + bytes((u[16 + j] & 15) | (u[24 + j] & 15) << 4 for j in range(8))
    return out


def test_the_layout_holds_q6_0_blocks_of_ik_llamas_values():
    """w4a8's head: ik_llama.cpp's Q6_0 values and scales, byte for byte as the module docstring lays them out,
    dequantized within half a step (a whole one where +32 steps clamp to +31); each weight's 6 bits where that
    docstring says."""
    g = torch.Generator().manual_seed(2)
    w = torch.randn(5, 96, generator=g) * 0.05
    w[3, 32:64] = 0
    blocks = torch.frombuffer(bytearray(_q6_0_blocks(w)), dtype=torch.uint8).reshape(-1, 26)
    d = blocks[:, :2].clone().view(torch.float16).reshape(5, 3)
    qs = blocks[:, 2:].clone().reshape(5, 72)
    got_qs, got_d = layout.quantize(w, "int6")
    assert layout.format_of(got_qs, got_d) == "q6_0" and torch.equal(got_qs, qs) and torch.equal(got_d, d)
    back = layout.dequantize(qs, d, torch.float32)
    step = d.float().abs().repeat_interleave(32, 1)
    err = (back - w).abs()
    assert torch.all(err <= step + 1e-6) and (err <= step * 0.51 + 1e-6).float().mean() > 0.95
    assert torch.equal(back[3, 32:64], torch.zeros(32))
    one = torch.zeros(1, 32)
    one[0, 0], one[0, 9], one[0, 17], one[0, 30] = -32.0, 31.0, 5.0, -17.0  # d = 1: u = w + 32
    (qs1,), _ = layout.quantize(one, "int6")
    assert qs1[0] == 0 | 2 << 6 and qs1[9] == 63 | 2 << 6 and qs1[1] == 32 | 2 << 6  # weights 16, 25, 17 (37)
    assert qs1[14] == 32 | 0 << 6  # weight 30: u 15
    assert qs1[16 + 1] == (37 & 15) | (32 & 15) << 4 and qs1[16 + 6] == (32 & 15) | (15 & 15) << 4
    assert layout.dequantize(qs1[None], torch.ones(1, 1, dtype=torch.float16), torch.float32).equal(one)


@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("arch", FAMILIES + MOE)
def test_the_weights_are_held_once_quantized(quantized, arch, scheme):
    """No float copy of a quantized weight stays in the model: what is left in the model's dtype is the norms',
    convolutions' and recurrent layers' small parameters and the routers (listed); the routed experts are
    held as blocks of the body's format."""
    rt = quantized(arch, scheme=scheme)
    q = rt.quantization
    assert q.layers > 0 and q.bytes_after < q.bytes_before / 3
    linears = [n for n, m in rt.model.named_modules() if type(m) is torch.nn.Linear]
    assert all(n in q.kept for n in linears), (linears, q.kept)
    assert not any(type(m) is torch.nn.Embedding for m in rt.model.modules())
    held = (layout.QuantLinear, layout.QuantEmbedding)
    shapes = {tuple(m.qs.shape) for m in rt.model.modules() if isinstance(m, held)}
    floats = [
        (n, tuple(t.shape))
        for n, t in [*rt.model.named_parameters(), *rt.model.named_buffers()]
        if t.is_floating_point() and t.dim() == 2 and tuple(t.shape) in shapes and n.split(".")[-2] not in quant.ROUTERS
    ]  # a router's shape may be a projection's
    assert not floats, floats
    head, embedding = rt.model.get_output_embeddings(), rt.model.get_input_embeddings()
    assert head.qs.dtype == torch.int8  # the head at Q8_0 under both weight-only schemes
    if rt.model.config.get_text_config().tie_word_embeddings:
        assert head.qs is embedding.qs and head.d is embedding.d  # one tensor for both
    else:
        assert embedding.qs.dtype == (torch.uint8 if scheme == "int4" else torch.int8)
    body = [m for m in rt.model.modules() if isinstance(m, layout.QuantLinear) and m is not head]
    assert body and all(m.qs.dtype == (torch.uint8 if scheme == "int4" else torch.int8) for m in body)
    assert not [(n, tuple(t.shape)) for n, t in rt.model.named_parameters() if t.dim() == 3 and "conv" not in n], (
        "a 3-D (expert) weight left in float"
    )
    held_experts = [m for m in rt.model.modules() if isinstance(m, qexperts.QuantExperts)]
    assert bool(held_experts) == (arch in ("qwen3_next",) + MOE)
    assert all(m.up_qs.dtype == m.down_qs.dtype == body[0].qs.dtype for m in held_experts)
    routers = [n for n in q.kept if q.kept[n].startswith("MoE router")]
    assert bool(routers) == (arch in ("qwen3_next", "qwen3_5_moe")), q.kept  # their shared_expert_gate
    assert all(n in routers or n.endswith(".dt_proj") for n in q.kept), q.kept  # Jamba's: input width dt_rank 4
    assert rt.kernels.on("native_int8") and rt.kernels.on("native_int4") == (scheme == "int4"), rt.kernels.status


@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_c_product_gives_dequantize_then_matmul(quantized, dtype, scheme):
    """Every weight of the model (the head among them), 1 to ROWS rows with a row stride of their own: the
    numbers of dequantize-then-matmul but for a last-place rounding; a row's result the same whatever batch it is
    in; more rows than ROWS left to the reference."""
    rt = quantized("qwen3_5", dtype, scheme)
    layers = [m for m in rt.model.modules() if isinstance(m, layout.QuantLinear)]
    assert layers and all(m.native is not None and m.native.format == layout.format_of(m.qs, m.d) for m in layers)
    g = torch.Generator().manual_seed(0)
    extra = layout.QuantLinear(
        *layout.quantize(torch.randn(300, 1024, generator=g) * 0.05, scheme),
        torch.randn(300, generator=g),
        torch.float32,
    )
    extra.native = next(m.native for m in layers if m.native.format == layout.format_of(extra.qs, extra.d))
    tol = 1e-4 if dtype == "float32" else 2e-2
    with torch.inference_mode():
        for m in [*layers, extra]:
            products = m.native
            k = m.in_features
            x = torch.randn(products.ROWS, 1, k + 7, generator=g).to(getattr(torch, dtype))[..., 3 : 3 + k]
            got = products(x, m)
            want = layout.dequantized_linear(x, m.qs, m.d, m.bias)
            assert got.dtype == x.dtype and got.shape == want.shape
            torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
            if dtype == "bfloat16":  # both sum the exact weights in float32 (in another order) and round once to
                assert (got == want).float().mean() > 0.99  # bfloat16: the same numbers but for a rare tie
            for r in range(products.ROWS):
                assert torch.equal(products(x[r : r + 1], m), got[r : r + 1])
            assert products(torch.zeros(products.ROWS + 1, 1, k), m) is None


SIBLING_NAMES = {"in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "q_proj", "k_proj", "v_proj"}
SIBLING_NAMES |= {"gate_proj", "up_proj"}


def _logits_of_a_chat(rt, n=6):
    """A prompt's logits and those of `n` greedy decode steps after it, one request."""

    def run():
        ad = rt.adapter
        state = ad.new_state()
        out = [ad.forward(state, list(range(5, 40)))]
        for _ in range(n):
            out.append(ad.forward_batch([state], [int(out[-1].reshape(-1, out[-1].shape[-1])[-1].argmax())])[0])
        ad.drop_batch()
        return out

    return model_thread.run(run)


@pytest.mark.parametrize("scheme", ["int8", "w4a8"])
def test_sibling_projections_run_one_product_over_their_blocks_stacked(quantized, model_dirs, monkeypatch, scheme):
    """A Gated DeltaNet's input projections, attention's q/k/v and an MLP's gate and up are one product: the members'
    values are views of the stack (held once), and a prompt's and its decode steps' logits are those of the members
    run apart, bit for bit."""
    rt = quantized("qwen3_5", "bfloat16", scheme)
    grouped = {n: m for n, m in rt.model.named_modules() if linear.GROUP in m.__dict__}
    assert {n.rsplit(".", 1)[-1] for n in grouped} == SIBLING_NAMES
    for m in grouped.values():
        stacked = m.__dict__[linear.GROUP].stacked
        assert m.qs.untyped_storage().data_ptr() == stacked.qs.untyped_storage().data_ptr()
        assert m.d.untyped_storage().data_ptr() == stacked.d.untyped_storage().data_ptr()
    monkeypatch.setenv("HYSERVE_GROUPED_LINEAR", "0")
    apart = ModelRuntime.load(model_dirs["qwen3_5"], dtype="bfloat16", device="cpu", quantization=scheme)
    assert not any(linear.GROUP in m.__dict__ for m in apart.model.modules())
    got, want = _logits_of_a_chat(rt), _logits_of_a_chat(apart)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_a_stack_that_differs_from_its_members_is_left_apart(model_dirs, monkeypatch, caplog):
    """The load-time check of the stacked product: one that gives other numbers than its members' own leaves every
    group apart (each member's own product runs), with a line saying so."""
    own = qsiblings.QuantSiblings.product
    monkeypatch.setattr(qsiblings.QuantSiblings, "product", lambda self, x: own(self, x) * 1.01)
    with caplog.at_level(logging.INFO, logger="hyserve.quant"):
        rt = ModelRuntime.load(model_dirs["qwen3_5"], dtype="bfloat16", device="cpu", quantization="int4")
    assert not any(linear.GROUP in m.__dict__ for m in rt.model.modules())
    assert "left apart" in caplog.text
    assert rt.kernels.on("native_int4")


def _greedy(rt, n=10, together=True):
    """Greedy tokens of two requests of different lengths, decoded in one batch or each alone."""

    def run():
        ad = rt.adapter
        states = [ad.new_state(), ad.new_state()]
        logits = [ad.forward(states[0], list(range(5, 40))), ad.forward(states[1], list(range(50, 61)))]
        ids = [[int(x.argmax())] for x in logits]
        for _ in range(n):
            if together:
                out = ad.forward_batch(states, [i[-1] for i in ids])
                ad_ids = out.argmax(-1).tolist()
            else:
                ad_ids = [int(ad.forward_batch([s], [i[-1]])[0].argmax()) for s, i in zip(states, ids)]
            for i, t in zip(ids, ad_ids):
                i.append(t)
        ad.drop_batch()
        return ids

    return model_thread.run(run)


# Every family at both formats: the four base families in full; the others' chats are two turns (the second
# restores the history the first decoded a reply to: each family's own layers are restored)
SCHEMES = ("int8", "int4")
EVERY = [(a, s) for a in FAMILIES + MOE + OTHERS for s in SCHEMES]


@pytest.mark.parametrize(
    "arch,dtype,scheme", [(a, "float32", s) for a, s in EVERY] + [("qwen3_5", "bfloat16", s) for s in SCHEMES]
)
def test_a_batched_decode_step_equals_each_row_alone(quantized, arch, dtype, scheme):
    rt = quantized(arch, dtype, scheme)
    assert rt.kernels.on("native_int8") and rt.kernels.on("native_int4") == (scheme == "int4"), rt.kernels.status
    together = _greedy(rt, together=True)
    assert together == _greedy(rt, together=False)
    assert together[0] != together[1]  # two prompts, two replies: a step that mixed up its rows would show


def _chat_matches_cache_off(make_service, arch, script, tol, tells_turns_apart=True, kernel="native_int8", **options):
    """`script`'s chat with the cache on and off: the same tokens, every reply at least one, the same numbers
    within `tol`, and each turn that shares the turn before's history restored from a checkpoint (at least that
    history, less than its whole prompt). A tiny random model may answer every turn with the same tokens: its
    numbers still differ from turn to turn by more than `tol` (`tells_turns_apart`), so a wrongly restored state
    would show."""
    on_service = make_service(arch, **options)
    assert on_service.runtime.kernels.on(kernel), on_service.runtime.kernels.status
    on = run_chat(on_service, script, logprobs=3)
    off = run_chat(make_service(arch, cache_enabled=False, **options), script, logprobs=3)
    assert [r[0] for r in on] == [r[0] for r in off] and all(r[0] for r in on)
    for turn, (got, want) in enumerate(zip(on, off)):
        diff = (torch.tensor(got[1]) - torch.tensor(want[1])).abs().max()
        assert diff <= tol, (turn, float(diff), got[1], want[1])
    first = [torch.tensor(r[1][0]) for r in on]  # the first reply token's numbers, per turn
    steps = [float((a - b).abs().max()) for a, b in zip(first, first[1:]) if a.shape == b.shape]
    assert not tells_turns_apart or (steps and min(steps) > tol), steps
    assert all(r[2] == 0 for r in off) and on[0][2] == 0
    shared = [t for t in range(1, len(script)) if script[t][0] == script[t - 1][0]]
    assert shared
    for turn in shared:
        assert on[turn - 1][4] <= on[turn][2] < on[turn][3], (turn, [r[2:] for r in on])


@pytest.mark.parametrize("arch,scheme", EVERY)
def test_chat_matches_cache_off_with_quantized_weights(make_service, arch, scheme):
    script = SCRIPT if arch in FAMILIES else SCRIPT[:2]
    _chat_matches_cache_off(make_service, arch, script, 1e-4, quantization=scheme)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_six_turn_chat_matches_cache_off_with_quantized_weights_in_bfloat16(make_service, scheme):
    """bfloat16's roundings differ between a cached turn's pieces and a whole prompt by up to ~1e-2 in a logprob,
    as much as this tiny model's first reply token changes from turn to turn: the float32 chats carry that check."""
    _chat_matches_cache_off(make_service, "qwen3_5", SCRIPT, 2e-2, False, dtype="bfloat16", quantization=scheme)


@pytest.mark.parametrize("kernel,function", [("native_int8", "dot_q8"), ("native_int4", "dot_q4")])
def test_a_wrong_build_is_refused_at_load(model_dirs, monkeypatch, tmp_path, fresh_library, caplog, kernel, function):
    """The source with one mistake in one format's product (each block weighted by the next block's scale) builds
    and runs; the load-time check refuses that product, with a warning, and its layers dequantize first; the
    other format's product stays on."""
    right = "const float scale = h2f(d[b]);"
    source = qnative.SOURCE.read_text()
    parts = source.split(f"static float {function}(")
    assert len(parts) == 4  # one per instruction set
    parts = [parts[0]] + [
        p.replace(right, "const float scale = h2f(d[b + 1 < blocks ? b + 1 : b]);", 1) for p in parts[1:]
    ]
    (tmp_path / "products.c").write_text(f"static float {function}(".join(parts))
    monkeypatch.setattr(qnative, "SOURCE", tmp_path / "products.c")
    with caplog.at_level(logging.WARNING, logger="hyserve.runtime"):
        rt = ModelRuntime.load(model_dirs["qwen3"], device="cpu", quantization="int4")
    status = rt.kernels.status
    assert status[kernel].startswith("off: max |diff|"), status
    other = "native_int4" if kernel == "native_int8" else "native_int8"
    assert rt.kernels.on(other), status
    layers = [m for m in rt.model.modules() if isinstance(m, layout.QuantLinear)]
    assert all((m.native is None) == (qnative.KERNELS[layout.format_of(m.qs, m.d)] == kernel) for m in layers)
    assert any(f"the C product {kernel} is off" in r.message for r in caplog.records)
    assert _greedy(rt, n=3)  # still serves


@pytest.mark.parametrize(
    "env,reason",
    [
        ({"CC": "/nonexistent/cc"}, "off: the C compiler does not run"),
        ({"HYSERVE_NATIVE": "0"}, "off: disabled"),
        ({"HYSERVE_KERNELS": "0"}, "off: disabled"),
    ],
)
def test_without_the_c_product_every_product_dequantizes_first(model_dirs, monkeypatch, fresh_library, env, reason):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    rt = ModelRuntime.load(model_dirs["qwen3"], device="cpu", quantization="int4")
    assert rt.kernels.status["native_int8"].startswith(reason), rt.kernels.status
    assert rt.kernels.status["native_int4"].startswith(reason), rt.kernels.status
    assert all(m.native is None for m in rt.model.modules() if isinstance(m, layout.QuantLinear))


def test_a_layer_that_does_not_fit_the_blocks_stays_unquantized_and_is_named():
    """An input width that is not a multiple of 32 (here attention's 4 heads x 20): that layer keeps its float
    weight, the start-up line names it, and the model still computes what it did within int8's rounding."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=20,
        tie_word_embeddings=True,
    )
    model = Qwen3ForCausalLM(config).eval()
    ids = torch.arange(3, 20)[None]
    with torch.inference_mode():
        want = model(ids).logits
    done = quant.apply(model, "int8")
    assert set(done.kept) == {f"model.layers.{i}.self_attn.o_proj" for i in range(2)}
    assert type(model.model.layers[0].self_attn.o_proj) is torch.nn.Linear
    assert "2 layer(s) whose input width is not a multiple of 32 (model.layers.0.self_attn.o_proj" in done.describe()
    with torch.inference_mode():
        got = model(ids).logits
    torch.testing.assert_close(got, want, atol=0.05, rtol=0.05)


def test_a_head_already_held_as_blocks_stays_so_and_is_named_as_it_is():
    """A GGUF file's Q8_0 head is kept as the file's blocks (the loader made it a `QuantLinear`): w4a8 does not
    re-quantize it to its Q6_0, and the start-up line names the head's format as held."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16,
    )  # fmt: skip
    model = Qwen3ForCausalLM(config).eval()
    kept = layout.QuantLinear(*layout.quantize(model.lm_head.weight, "int8"), None, torch.float32)
    model.lm_head = kept
    done = quant.apply(model, "w4a8")
    assert model.get_output_embeddings() is kept and layout.format_of(kept.qs, kept.d) == "q8_0"
    assert done.describe().startswith("w4a8 (Q4_0, the head Q8_0;")
    fresh = Qwen3ForCausalLM(config).eval()
    assert quant.apply(fresh, "w4a8").describe().startswith("w4a8 (Q4_0, the head Q6_0;")
    head = fresh.get_output_embeddings()
    assert layout.format_of(head.qs, head.d) == "q6_0"


def test_a_scheme_or_device_it_cannot_serve_is_one_clear_error(model_dirs):
    with pytest.raises(ValueError, match="quantization must be one of int8, int4"):
        ModelRuntime.load(model_dirs["qwen3"], device="cpu", quantization="fp8")
    with pytest.raises(ValueError, match="runs on CPU only"):
        ModelRuntime.load(model_dirs["qwen3"], device="cuda", quantization="int8")


def test_hyserve_env_reports_the_quantization_and_its_check(model_dirs, capsys):
    from hyserve.cli import main

    assert main(["env", str(model_dirs["qwen3"]), "--quantization", "int4"]) == 0
    out = capsys.readouterr().out
    assert "quantization: int4 (Q4_0, the head Q8_0, blocks of 32)" in out
    assert "kernel native_int8: on" in out and "kernel native_int4: on" in out
    assert f"quantized products: {qnative.ISAS[qnative.library()[0].q8_isa()]}" in out


@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("arch", FAMILIES)
def test_speculation_equals_plain_decode_with_quantized_weights(make_service, arch, scheme):
    """A verification pass (a few rows: the C product, each row as it would be alone) accepts exactly what
    plain decoding makes."""
    from hyserve.engine.speculative import SpeculativeConfig

    from .test_speculative import OracleProposer, generate

    plain = make_service(arch, quantization=scheme)
    spec = make_service(arch, quantization=scheme, speculative=SpeculativeConfig())
    ref = generate(plain, 24)
    spec.engine.make_proposer = lambda prompt: OracleProposer(prompt, ref.token_ids)
    assert generate(spec, 24).token_ids == ref.token_ids
    assert spec.metrics.spec_accepted._value.get() >= 8


def test_the_disk_cache_tells_quantized_states_from_others(quantized, runtimes):
    """A state saved by the float model (or by the other scheme) is never restored into a quantized one."""
    from hyserve.cache.fingerprint import fingerprint

    prints = {fingerprint(rt, "") for rt in (runtimes("qwen3"), quantized("qwen3"), quantized("qwen3", scheme="int4"))}
    assert len(prints) == 3


@pytest.mark.parametrize("scheme", ["int8", "int4", "int6"])
def test_a_weight_is_quantized_the_same_a_slice_of_rows_at_a_time(monkeypatch, scheme):
    g = torch.Generator().manual_seed(3)
    w = torch.randn(70, 96, generator=g) * 0.03
    whole = layout.quantize(w, scheme)
    monkeypatch.setattr(layout, "CHUNK", 96 * 8)  # 8 rows a slice, the last one short
    sliced = layout.quantize(w, scheme)
    assert all(torch.equal(a, b) for a, b in zip(whole, sliced))


def _experts(kind: str):
    """A transformers experts module with random weights: gated (Qwen3-Next's) or not (Nemotron-H's)."""
    if kind == "gated":
        from transformers import Qwen3NextConfig
        from transformers.models.qwen3_next import modeling_qwen3_next

        Experts = modeling_qwen3_next.Qwen3NextExperts
        config = Qwen3NextConfig(hidden_size=64, moe_intermediate_size=96, num_experts=5)
    else:
        from transformers import NemotronHConfig
        from transformers.models.nemotron_h import modeling_nemotron_h

        Experts = modeling_nemotron_h.NemotronHExperts
        config = NemotronHConfig(hidden_size=64, moe_intermediate_size=96, n_routed_experts=5)
    config._experts_implementation = "eager"
    module = Experts(config)
    g = torch.Generator().manual_seed(4)
    for p in module.parameters():
        p.data = torch.randn(p.shape, generator=g) * 0.1
    return module


@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("kind", ["gated", "plain"])
def test_quantized_experts_compute_transformers_eager_loop_and_a_token_alone_as_in_its_batch(kind, scheme):
    """`QuantExperts` against transformers' own eager loop over the dequantized weights; with the C product on,
    each token of a batch gets bit for bit what it gets alone while no expert is hit by more than `C_ROWS` rows
    (here experts hit by 9 to 13: the C product 8 rows at a time), and past that (dequantize-then-matmul) the
    eager loop's numbers."""
    module = _experts(kind)
    held = qexperts.QuantExperts(module, scheme)
    up, down = qexperts.fused_weights(module)
    for name, qs, d in ((up, held.up_qs, held.up_d), (down, held.down_qs, held.down_d)):
        getattr(module, name).data = torch.stack(
            [layout.dequantize(qs[e], d[e], torch.float32) for e in range(held.num_experts)]
        )
    g = torch.Generator().manual_seed(5)
    x = torch.randn(100, 64, generator=g)
    index = torch.stack([torch.randperm(5, generator=g)[:2] for _ in range(100)])
    index[:28][index[:28] == 4] = 5  # the first 28 tokens: no expert 4, and an index outside the experts as in
    weights = torch.rand(100, 2, generator=g)  # expert parallelism (nothing added for it)
    with torch.inference_mode():
        torch.testing.assert_close(held(x, index, weights), module(x, index, weights), atol=1e-5, rtol=1e-5)
    lib, why = qnative.library()
    assert lib is not None, why
    fmt = layout.format_of(held.up_qs[0], held.up_d[0])
    assert qnative._install(qnative.Products(lib, fmt), held.linears(), torch.float32) == ""
    rows = qnative.Products.ROWS
    hits = torch.bincount(index[:28].reshape(-1), minlength=6)[:5]
    assert rows < hits.max() <= qexperts.C_ROWS and hits[4] == 0, hits
    assert torch.bincount(index.reshape(-1)).max() > qexperts.C_ROWS

    def alone_and_together():
        with torch.inference_mode():
            together = held(x[:28], index[:28], weights[:28])
            alone = [held(x[i : i + 1], index[i : i + 1], weights[i : i + 1]) for i in range(28)]
            return together, torch.cat(alone), held(x, index, weights)

    together, alone, many = model_thread.run(alone_and_together)
    assert torch.equal(together, alone)
    with torch.inference_mode():
        torch.testing.assert_close(together, module(x[:28], index[:28], weights[:28]), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(many, module(x, index, weights), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "config",
    [
        {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True},
        {"quant_method": "fp8", "weight_block_size": [128, 128]},
        {"quant_method": "compressed-tensors", "format": "pack-quantized"},
    ],
)
def test_an_already_quantized_checkpoint_is_refused_at_start_in_one_line(model_dirs, tmp_path, capfd, config):
    """Pre-quantized weights are not read yet: `hyserve serve` says so in one line that names the method, before any
    weight is read, and a direct load raises the same; never a silently different model."""
    import json
    import shutil

    from hyserve.cli import main

    folder = tmp_path / "model"
    shutil.copytree(model_dirs["qwen3"], folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = config
    (folder / "config.json").write_text(json.dumps(cfg))
    method = config["quant_method"]
    assert main(["serve", str(folder), "--port", "0"]) == 2
    out = capfd.readouterr()
    lines = [line for line in (out.out + out.err).splitlines() if line.strip()]
    assert len(lines) == 1 and "cannot start" in lines[0] and f"quantization_config method '{method}'" in lines[0], (
        lines
    )
    with pytest.raises(ValueError, match=f"method '{method}'"):
        ModelRuntime.load(folder, device="cpu", quantization="int8")
    assert quant.checkpoint.method_of(model_dirs["qwen3"]) is None

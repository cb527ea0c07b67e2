"""`--quantization w8a8|w4a8`: the int8 / int4 weights of `--quantization int8|int4`, each product's input rounded
to Q8_0 blocks and multiplied in integers (`a8_products.c`), as llama.cpp computes its Q8_0 and Q4_0 files. The C
rounding is the PyTorch one value for value, the C product is the rounded reference's but for float32 rounding
and each row's alone, a wrong build is refused at load (then PyTorch rounds: the same tokens), and the standards
hold: cache on == cache off, batched == single, speculation == plain decode."""

from __future__ import annotations

import pytest
import torch

from hyserve.models.runtime import ModelRuntime
from hyserve.quant import layout
from hyserve.quant import native as qnative

from .conftest import FAMILIES
from .test_engine_cache import SCRIPT
from .test_quant import MOE, _chat_matches_cache_off, _greedy

A8 = ("w8a8", "w4a8")


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    """Each instruction set's build of `a8_products.c` this CPU runs (the portable one always)."""
    folder = tmp_path_factory.mktemp("a8")
    best, why = qnative.a8_library()
    assert best is not None, why
    libs = []
    for isa in range(best.a8_isa() + 1):
        source = folder / f"a8_isa{isa}.c"
        source.write_text(f"#define A8_ISA {isa}\n{qnative.A8_SOURCE.read_text()}")
        lib, why = qnative.load_a8(source)
        assert lib is not None and lib.a8_isa() == isa, why
        libs.append(lib)
    return libs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_c_rounding_is_pytorchs_value_for_value(builds, dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 96, generator=g) * torch.tensor([1e-3, 1.0, 300.0])[:, None].repeat(1, 32).reshape(1, 96)
    x[1, 32:64] = 0  # a block of zeros: d 0, every q 0
    x[2, :32] = torch.arange(32) * 0.5 - 8  # values halfway between two steps
    x = x.to(dtype)
    want = layout.round_activations(x)
    for lib in builds:
        q = torch.empty(5, 96, dtype=torch.int8)
        d = torch.empty(5, 3, dtype=torch.float32)
        sum8 = torch.empty(5, 3, dtype=torch.int32)
        assert (
            lib.round_rows(
                5, 96, x.data_ptr(), 96, x.dtype == torch.bfloat16, q.data_ptr(), d.data_ptr(), sum8.data_ptr()
            )
            == 0
        )
        got = (q.float().view(5, 3, 32) * d[..., None]).view(5, 96)
        assert torch.equal(got, want)
        assert torch.equal(sum8, 8 * q.view(5, 3, 32).int().sum(-1))
        assert (q.abs() <= 127).all() and q.abs().amax() == 127


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_c_rounding_is_pytorchs_on_exact_halves_and_every_magnitude(builds, dtype):
    """Blocks whose scaled values are exact halves (d = 1: roundf takes them away from zero, torch's round would
    take them to even), and 64 rows of 1,024 values whose blocks span twelve orders of magnitude."""
    g = torch.Generator().manual_seed(2)
    halves = torch.cat([torch.tensor([127.0]), torch.arange(-62, 62, 4) + 0.5, torch.tensor([-0.5])])
    spread = torch.randn(64, 1024, generator=g) * 10 ** torch.randint(-6, 7, (64, 32, 1), generator=g).float().repeat(
        1, 1, 32
    ).reshape(64, 1024)
    for x in (halves[None, : 32 * (halves.numel() // 32)].to(dtype), spread.to(dtype)):
        rows, k = x.shape
        want = layout.round_activations(x)
        for lib in builds:
            q = torch.empty(rows, k, dtype=torch.int8)
            d = torch.empty(rows, k // 32, dtype=torch.float32)
            sum8 = torch.empty(rows, k // 32, dtype=torch.int32)
            assert (
                lib.round_rows(
                    rows, k, x.data_ptr(), k, x.dtype == torch.bfloat16, q.data_ptr(), d.data_ptr(), sum8.data_ptr()
                )
                == 0
            )
            assert torch.equal((q.float().view(rows, -1, 32) * d[..., None]).view(rows, k), want)
            assert torch.equal(sum8, 8 * q.view(rows, -1, 32).int().sum(-1))


@pytest.mark.parametrize("scheme", ["int8", "int4", "int6"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_c_product_is_the_rounded_reference_and_each_rows_alone(builds, scheme, dtype):
    """Widths of 8 blocks and not (the scales taken 8 at a time, then one by one), weight rows in whole sets of 8
    and not (the last set padded), 1 to 70 rows (tiles of 4, then the rest; a long prefill piece) with a stride of
    their own: the rounded reference's numbers but for float32 rounding, a row's result the same whatever batch it
    is in, and far from the product of the unrounded input (the rounding is done). Over the same weights held
    interleaved (whole sets only), the same outputs bit for bit."""
    g = torch.Generator().manual_seed(1)
    for n, k in ((37, 96), (16, 320), (40, 96), (300, 1024), (304, 1024)):
        layer = layout.QuantLinear(
            *layout.quantize(torch.randn(n, k, generator=g) * 0.05, scheme), torch.randn(n, generator=g), dtype
        )
        x = torch.randn(70, k + 5, generator=g).to(dtype)[:, 2 : 2 + k]
        want = layout.dequantized_linear(x, layer.qs, layer.d, layer.bias, rounded=True)
        unrounded = layout.dequantized_linear(x, layer.qs, layer.d, layer.bias)
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        interleaved = None
        if n % 8 == 0:
            interleaved = layout.QuantLinear(layer.qs.clone(), layer.d.clone(), layer.bias, dtype)
            layout.interleave_(interleaved.qs, interleaved.d)
            interleaved.interleaved = True
            assert not torch.equal(interleaved.qs, layer.qs) and not torch.equal(interleaved.d, layer.d)
        for lib in builds:
            products = qnative.A8Products(lib)
            with torch.inference_mode():
                got = products(x, layer)
                assert got.dtype == dtype and got.shape == want.shape
                torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
                if dtype == torch.float32:  # in bfloat16 the rounding is below the output's own
                    assert (got - unrounded).abs().max() > 100 * tol
                for r in (0, 7, 8, 20, 69):
                    assert torch.equal(products(x[r : r + 1], layer), got[r : r + 1])
                assert torch.equal(products(x[3:12], layer), got[3:12])
                assert torch.equal(products(x[1:68], layer), got[1:68])
                if interleaved is not None:
                    assert torch.equal(products(x, interleaved), got)
                    for r in (0, 8, 69):
                        assert torch.equal(products(x[r : r + 1], interleaved), got[r : r + 1])
                    assert torch.equal(products(x[3:12], interleaved), got[3:12])


def test_interleaved_values_read_back_as_the_rows_they_hold():
    """`interleave_` and back restore every byte; the dequantized weight, the reference product and an
    embedding's lookup over interleaved values are those of the rows; the C library refuses an interleaved weight
    whose rows are not whole sets."""
    g = torch.Generator().manual_seed(3)
    for scheme in ("int8", "int4", "int6"):
        qs, d = layout.quantize(torch.randn(48, 96, generator=g), scheme)
        held_qs, held_d = qs.clone(), d.clone()
        layout.interleave_(held_qs, held_d)
        assert not torch.equal(held_qs, qs)
        weight = layout.dequantize(qs, d, torch.float32)
        assert torch.equal(layout.dequantize(held_qs, held_d, torch.float32, interleaved=True), weight)
        x = torch.randn(3, 96, generator=g)
        assert torch.equal(
            layout.dequantized_linear(x, held_qs, held_d, None, True, interleaved=True),
            layout.dequantized_linear(x, qs, d, None, True),
        )
        embedding = layout.QuantEmbedding(held_qs, held_d, torch.float32)
        embedding.interleaved = True
        ids = torch.tensor([[0, 5, 47], [12, 12, 3]])
        assert torch.equal(embedding(ids), weight[ids])
        layout.interleave_(held_qs, held_d, back=True)
        assert torch.equal(held_qs, qs) and torch.equal(held_d, d)
    lib = qnative.a8_library()[0]
    x, y = torch.randn(1, 96), torch.empty(1, 44)
    qs, d = layout.quantize(torch.randn(44, 96, generator=g), "int4")
    args = (1, 44, 96, x.data_ptr(), 96, 0, qs.data_ptr(), d.data_ptr(), None, y.data_ptr(), 1)
    assert lib.a8_linear(qnative.A8_FORMATS["q4_0"], *args) == 0
    assert lib.a8_linear(qnative.A8_FORMATS["q4_0"] + qnative.INTERLEAVED, *args) == -1


def test_a_wrong_build_is_refused_at_load_and_pytorch_rounds_instead(model_dirs, monkeypatch, tmp_path, caplog):
    """The source with one mistake (Q4_0's and Q6_0's products without the nibbles' offset taken back) builds and
    runs; the load-time check refuses it with a warning, every layer rounds its input in PyTorch instead over its
    values put back row after row (the C product's are interleaved), and the tokens are the C product's."""
    right = "sums = _mm256_sub_epi32(sums, _mm256_set1_epi32(xs[r * blocks + b] * (fmt == Q6 ? 4 : 1)));"
    source = qnative.A8_SOURCE.read_text()
    if qnative.a8_library()[0].a8_isa() == 0:
        pytest.skip("the portable build takes no 8 * x back")
    assert source.count(right) == 1
    (tmp_path / "a8_products.c").write_text(source.replace(right, ";"))
    good = ModelRuntime.load(model_dirs["qwen3"], device="cpu", quantization="w4a8")
    assert good.kernels.on(qnative.A8_KERNEL), good.kernels.status
    assert all(m.interleaved for m in good.model.modules() if isinstance(m, layout.QuantLinear))
    monkeypatch.setattr(qnative, "A8_SOURCE", tmp_path / "a8_products.c")
    monkeypatch.setenv("HYSERVE_NATIVE_CACHE", str(tmp_path / "native"))
    qnative.a8_library.cache_clear()
    try:
        rt = ModelRuntime.load(model_dirs["qwen3"], device="cpu", quantization="w4a8")
    finally:
        qnative.a8_library.cache_clear()
    assert rt.kernels.status[qnative.A8_KERNEL].startswith("off: max |diff|"), rt.kernels.status
    layers = [m for m in rt.model.modules() if isinstance(m, layout.QuantLinear)]
    assert layers and all(m.native is None and m.rounds_activations and not m.interleaved for m in layers)
    assert _greedy(rt, n=6) == _greedy(good, n=6)


@pytest.mark.parametrize("scheme", A8)
@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_next", "mamba2", "nemotron_h"])
def test_chat_matches_cache_off_with_int8_activations(make_service, arch, scheme):
    """The same tokens, and numbers within int8 / int4's 1e-4: a cached turn's short piece and the cache-off
    prompt's long one run the same C product, whose results do not depend on the piece's length."""
    script = SCRIPT if arch in FAMILIES else SCRIPT[:2]
    _chat_matches_cache_off(make_service, arch, script, 1e-4, kernel=qnative.A8_KERNEL, quantization=scheme)


@pytest.mark.parametrize("scheme", A8)
@pytest.mark.parametrize("arch", ["qwen3_5", MOE[0], "qwen3"])
def test_a_batched_decode_step_equals_each_row_alone_with_int8_activations(model_dirs, arch, scheme):
    rt = ModelRuntime.load(model_dirs[arch], device="cpu", dtype="bfloat16", quantization=scheme)
    assert rt.kernels.on(qnative.A8_KERNEL), rt.kernels.status
    layers = [m for m in rt.model.modules() if isinstance(m, layout.QuantLinear)]
    assert layers and all(m.rounds_activations and isinstance(m.native, qnative.A8Products) for m in layers)
    together = _greedy(rt, together=True)
    assert together == _greedy(rt, together=False)
    assert together[0] != together[1]


def test_int8_activations_change_the_numbers_and_keep_the_weights(model_dirs):
    """w4a8 holds int4's body byte for byte (interleaved for its C product, read back row after row) and its head
    at Q6_0 (int4's at Q8_0); its logits differ from int4's by the activations' rounding and the head's, far less
    than from the float model's."""
    rts = {s: ModelRuntime.load(model_dirs["qwen3_5"], device="cpu", quantization=s) for s in ("int4", "w4a8")}
    rts["float"] = ModelRuntime.load(model_dirs["qwen3_5"], device="cpu")
    heads = {s: rts[s].model.get_output_embeddings() for s in ("int4", "w4a8")}
    assert [layout.format_of(h.qs, h.d) for h in heads.values()] == ["q8_0", "q6_0"]
    a, b = (dict(rts[s].model.named_buffers()) for s in ("int4", "w4a8"))
    assert a.keys() == b.keys()
    held = (layout.QuantLinear, layout.QuantEmbedding)
    a, b = ({n: m for n, m in rts[s].model.named_modules() if isinstance(m, held)} for s in ("int4", "w4a8"))
    body = [n for n in a if a[n] is not heads["int4"]]
    assert a.keys() == b.keys() and len(body) == len(a) - 1 and any(b[n].interleaved for n in body)
    for n in body:
        qs, d = b[n].qs.clone(), b[n].d.clone()
        if b[n].interleaved:
            layout.interleave_(qs, d, back=True)
        assert torch.equal(qs, a[n].qs) and torch.equal(d, a[n].d), n
    ids = list(range(5, 40))
    logits = {s: rt.adapter.forward(rt.adapter.new_state(), ids).float() for s, rt in rts.items()}
    rounding = (logits["w4a8"] - logits["int4"]).abs().max()
    assert 1e-4 < rounding < (logits["int4"] - logits["float"]).abs().max()


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3"])
def test_speculation_equals_plain_decode_with_int8_activations(make_service, arch):
    from hyserve.engine.speculative import SpeculativeConfig

    from .test_speculative import OracleProposer, generate

    plain = make_service(arch, quantization="w4a8")
    spec = make_service(arch, quantization="w4a8", speculative=SpeculativeConfig())
    ref = generate(plain, 24)
    spec.engine.make_proposer = lambda prompt: OracleProposer(prompt, ref.token_ids)
    assert generate(spec, 24).token_ids == ref.token_ids
    assert spec.metrics.spec_accepted._value.get() >= 8


def test_hyserve_env_reports_int8_activations(model_dirs, capsys):
    from hyserve.cli import main

    assert main(["env", str(model_dirs["qwen3"]), "--quantization", "w4a8"]) == 0
    out = capsys.readouterr().out
    assert "quantization: w4a8 (Q4_0, the head Q6_0; each product's input rounded to Q8_0 blocks" in out
    assert f"kernel {qnative.A8_KERNEL}: on" in out and "native_int4" not in out
    assert f"quantized products: {qnative.A8_ISAS[qnative.a8_library()[0].a8_isa()]}" in out


def test_the_disk_cache_tells_int8_activations_from_weight_only(model_dirs):
    from hyserve.cache.fingerprint import fingerprint

    prints = {
        s: fingerprint(ModelRuntime.load(model_dirs["qwen3"], device="cpu", quantization=s), "")
        for s in ("int4", "w4a8")
    }
    assert prints["int4"] != prints["w4a8"]

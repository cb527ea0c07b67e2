"""A GGUF file's Q4_1, Q5_0, Q5_1, Q4_K, Q5_K and Q6_K tensors held as the file's blocks (`quant.ggml_blocks`):
dequantized bit for bit as gguf-py does, multiplied in C (`ggml_products.c`, each instruction set this CPU runs) as
the reference computes, refused at load when wrong, and a tiny Qwen3.5 file of each type loaded with every linear
layer kept (the file's bytes, not a float copy) and served cache on as off."""

import json
import shutil

import numpy as np
import pytest
import torch

pytest.importorskip("gguf")

from hyserve.kernels import verify  # noqa: E402
from hyserve.models.runtime import ModelRuntime  # noqa: E402
from hyserve.quant import ggml_blocks, ggml_library, ggml_native  # noqa: E402
from hyserve.quant.ggml_blocks import TYPES, GgmlEmbedding, GgmlLinear  # noqa: E402

from .gguf_files import convert as run_converter  # noqa: E402
from .gguf_files import kquantize, requantize  # noqa: E402
from .test_engine_cache import SCRIPT, run_chat  # noqa: E402
from .test_gguf import _cli, _logits, llama_cpp_converter  # noqa: E402,F401

KINDS = list(TYPES)


def _isas() -> list[int]:
    """The instruction sets of `ggml_products.c` this CPU runs: portable C, and AVX2 where it has it."""
    lib, why = ggml_library.library()
    assert lib is not None, why
    return list(range(lib.a8_isa() + 1))


def _random_blocks(kind: str, n: int, k: int, rng) -> torch.Tensor:
    """n rows of k weights of `kind`: random bytes, the float16 scales set to small finite values."""
    _, weights, size = TYPES[kind]
    b = rng.integers(0, 256, (n, k // weights, size), dtype=np.uint8)
    for at in {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "Q4_1": (0, 2), "Q5_1": (0, 2)}.get(kind, (0,)):
        scale = rng.uniform(-0.02, 0.02, b.shape[:2]).astype(np.float16)
        b[:, :, at : at + 2] = scale.view(np.uint8).reshape(*b.shape[:2], 2)
    if kind == "Q6_K":  # its int8 scales small too, so that products stay in float32's exact range for the test
        b[:, :, 192:208] = rng.integers(-8, 8, (*b.shape[:2], 16)).astype(np.int8).view(np.uint8)
    return torch.from_numpy(b.reshape(n, -1))


@pytest.mark.parametrize("kind", KINDS)
def test_dequantize_is_gguf_py_bit_for_bit(kind):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    rng = np.random.default_rng(0)
    blocks = _random_blocks(kind, 37, 512, rng)
    want = dequantize(blocks.numpy(), GGMLQuantizationType[kind]).reshape(37, 512).astype(np.float32)
    for isa in _isas():
        lib, why = ggml_library.load(isa)
        assert lib is not None, why
        out = torch.empty(37, 512)
        assert lib.ggml_dequantize(TYPES[kind][0], 37, 512, blocks.data_ptr(), blocks.shape[1], out.data_ptr()) == 0
        assert np.array_equal(out.numpy().view(np.uint32), want.view(np.uint32)), (kind, isa)
    assert torch.equal(ggml_blocks.dequantize(blocks, kind, 512), torch.from_numpy(want))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rounded", [True, False], ids=["int8-activations", "as-they-are"])
def test_the_product_is_the_reference_and_a_row_is_the_same_in_any_batch(kind, dtype, rounded):
    rng = np.random.default_rng(1)
    n, k = 45, 768  # not a whole number of the product's groups of rows; three K-quant blocks a row
    blocks = _random_blocks(kind, n, k, rng)
    layer = GgmlLinear(blocks, kind, k, torch.randn(n, generator=torch.Generator().manual_seed(0)), dtype)
    layer.rounds_activations = rounded
    x = torch.randn(19, k, generator=torch.Generator().manual_seed(2)).to(dtype)
    want = ggml_blocks.reference_linear(x, blocks, kind, layer.bias, rounded)
    for isa in _isas():
        lib, why = ggml_library.load(isa)
        products = ggml_native.GgmlProducts(lib)
        got = products(x, layer)
        # relative to each row's largest output: random blocks (offsets far from their weights' mean) make sums
        # that cancel to near 0, where float32 rounding of the large terms is all that is left
        scale = want.float().abs().amax(-1, keepdim=True)
        why = verify.mismatch(got.float() / scale, want.float() / scale, dtype)
        assert why is None, (isa, why)
        for rows in (1, 2, 3, 5, 8):  # each row alone, and in batches of other sizes: bit for bit
            parts = torch.cat([products(x[a : a + rows], layer) for a in range(0, 19, rows)])
            assert torch.equal(parts, got), (isa, rows)


def test_a_product_that_does_not_match_is_refused_at_load(monkeypatch):
    class Off(ggml_native.GgmlProducts):
        def __call__(self, x, layer):
            y = super().__call__(x, layer)
            return None if y is None else y * 1.01

    blocks = _random_blocks("Q4_K", 16, 256, np.random.default_rng(3))
    model = torch.nn.Sequential(GgmlLinear(blocks, "Q4_K", 256, None, torch.float32))
    monkeypatch.setattr(ggml_native, "GgmlProducts", Off)
    decided = ggml_native.install(model, torch.float32)
    assert "max |diff|" in decided[ggml_native.KERNEL] and model[0].native is None
    monkeypatch.undo()
    assert ggml_native.install(model, torch.float32) == {ggml_native.KERNEL: ""}
    assert isinstance(model[0].native, ggml_native.GgmlProducts)


# A Qwen3.5 whose every linear layer's input is a multiple of 256 (K-quant blocks): hidden 256, 4 x 64 value heads
WIDE = dict(
    hidden_size=256,
    intermediate_size=512,
    head_dim=64,
    linear_key_head_dim=64,
    linear_value_head_dim=64,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
)


@pytest.fixture(scope="module")
def wide_f32(llama_cpp_converter, model_dirs, tmp_path_factory):  # noqa: F811 (the imported fixture)
    """The WIDE Qwen3.5 folder (random-init, the tiny tokenizer) and its F32 file from llama.cpp's converter."""
    from transformers import AutoConfig, AutoModelForCausalLM

    src, folder = model_dirs["qwen3_5"], tmp_path_factory.mktemp("qwen3_5-wide")
    for f in src.iterdir():
        if f.name not in ("config.json", "model.safetensors"):
            shutil.copy(f, folder / f.name)
    cfg = json.loads((src / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(cfg | WIDE))
    torch.manual_seed(1)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder)).save_pretrained(folder)
    out = tmp_path_factory.mktemp("gguf") / "wide-f32.gguf"
    return folder, run_converter(llama_cpp_converter, folder, out, "f32", "--no-mtp")


def _qtype_of(kind: str):
    from gguf import GGMLQuantizationType

    def qtype(name, shape):
        if len(shape) == 2 and shape[1] % TYPES[kind][1] == 0 and name.endswith(".weight") and "norm" not in name:
            return GGMLQuantizationType[kind]
        return None

    return qtype


@pytest.fixture(scope="module")
def files(wide_f32, tmp_path_factory):
    """kind -> the WIDE file with every 2-D weight (the head and the embedding too) in that type."""
    made = {}

    def get(kind):
        if kind not in made:
            made[kind] = requantize(wide_f32[1], tmp_path_factory.mktemp("gguf") / f"wide-{kind}.gguf", _qtype_of(kind))
        return made[kind]

    return get


@pytest.mark.parametrize("kind", [k for k in KINDS if k not in ("Q8_0", "Q4_0")])
def test_a_file_of_each_type_is_held_as_its_blocks_and_serves_cache_on_as_off(files, make_service, kind):
    from gguf import GGUFReader

    path = files(kind)
    tensors = {t.name: t for t in GGUFReader(path).tensors}
    quantized = {n for n, t in tensors.items() if t.tensor_type.name == kind}
    rt = ModelRuntime.load(path, device="cpu")
    done = rt.gguf_tensors
    # every one kept; in a K-quant, Gated DeltaNet's out_proj too, whose value heads (64 columns each) the
    # converter reordered within blocks of 256: its input is put in the file's column order instead
    moved = set()
    assert done.converted == {"F32": len(tensors) - len(quantized)}
    out_projs = [layer.linear_attn.out_proj for layer in rt.model.model.layers if hasattr(layer, "linear_attn")]
    assert len(out_projs) == 3 and all((m.gather is not None) == (TYPES[kind][1] > 64) for m in out_projs)
    assert rt.kernels.status["decode_layer"] == "on", rt.kernels.status
    assert done.kept == {kind: len(quantized) - len(moved)}
    layers = [m for m in rt.model.modules() if isinstance(m, GgmlLinear)]
    assert isinstance(rt.model.get_input_embeddings(), GgmlEmbedding)
    assert isinstance(rt.model.get_output_embeddings(), GgmlLinear)
    assert all(m.kind == kind and isinstance(m.native, ggml_native.GgmlProducts) for m in layers)
    assert rt.kernels.status[ggml_native.KERNEL] == "on"
    # held: the file's bytes of those tensors, not a float copy
    assert ggml_blocks.nbytes(rt.model) == sum(int(tensors[n].n_bytes) for n in quantized - moved)
    head = rt.model.get_output_embeddings()
    assert torch.equal(head.blocks, torch.from_numpy(np.array(tensors["output.weight"].data)))
    # the C products give the reference's logits (the weights dequantized as gguf-py does, inputs rounded alike)
    got = _logits(rt)
    for m in layers:
        m.native = None
    want = _logits(rt)
    assert (got - want).abs().max() < 1e-4 * want.abs().max()
    for m in layers:
        m.native = ggml_native.GgmlProducts(ggml_library.library()[0])
    on = run_chat(make_service("qwen3_5", model_dir=path), SCRIPT[:3], logprobs=2)
    off = run_chat(make_service("qwen3_5", model_dir=path, cache_enabled=False), SCRIPT[:3], logprobs=2)
    assert on[1][2] > 0 and on[2][2] > 0 and all(t[2] == 0 for t in off)
    assert_same_replies(on, off)


NEAR_TIE = 2e-2  # logprob gap under which activations rounded to int8 may order two tokens either way (see below)


def assert_same_replies(on: list, off: list) -> None:
    """Cache on's greedy tokens are cache off's, up to a near tie. Products that round their inputs to int8 turn a
    float32 difference of ~1e-7 (a prefill split at another token: cache on takes checkpoints inside its pieces)
    into up to ~1e-2 in the logits when a value sits on a rounding edge (blocks of 256 for K-quants), as in
    llama.cpp; so two tokens whose logprobs
    cache off puts within NEAR_TIE of each other may come out swapped. The first difference must be such a tie,
    with the logprobs up to it close; the chat stops being compared there (its history then differs)."""
    compared = 0
    for (got, got_lp, *_), (want, want_lp, *_) in zip(on, off):
        for i, (a, b) in enumerate(zip(got, want)):
            assert abs(got_lp[i][0] - want_lp[i][0]) < 2e-2, (i, got_lp[i], want_lp[i])
            if a != b:
                assert want_lp[i][1] - want_lp[i][2] < NEAR_TIE, (i, want_lp[i])  # the best and the second best
                assert compared >= 8, compared  # not from the start: the test would show nothing
                return
            compared += 1


def test_weight_only_on_request_gives_the_dequantized_weights_numbers(files):
    """`--quantization int8` on such a file: the blocks stay, the activations are taken as they are (C products
    over them), and the logits are those of the file dequantized as gguf-py does (transformers' loading)."""
    path = files("Q4_K")
    rt = ModelRuntime.load(path, device="cpu", quantization="int8")
    layers = [m for m in rt.model.modules() if isinstance(m, GgmlLinear)]
    assert layers and not any(m.rounds_activations for m in layers)
    assert all(isinstance(m.native, ggml_native.GgmlProducts) for m in layers)
    got = _logits(rt)
    for m in layers:
        m.native = None  # the reference: the weight dequantized, times x in float32
    want = _logits(rt)
    assert (got - want).abs().max() < 1e-5 * want.abs().max()
    assert not torch.equal(got, _logits(ModelRuntime.load(path, device="cpu")))  # not the rounded default


def test_the_file_gives_the_folders_model(wide_f32, files):
    """Q6_K of the WIDE folder's weights: its logits follow the folder's float ones (what was quantized is the
    folder's model), and its greedy next tokens mostly agree."""
    folder = ModelRuntime.load(wide_f32[0], device="cpu")
    rt = ModelRuntime.load(files("Q6_K"), device="cpu")
    got, want = _logits(rt), _logits(folder)
    assert torch.corrcoef(torch.stack([got.flatten(), want.flatten()]))[0, 1] > 0.99
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.8


def test_env_says_every_tensor_of_a_k_quant_file_is_kept(files):
    r = _cli("env", str(files("Q4_K")))
    assert r.returncode == 0, r.stderr
    assert "Q4_K kept quantized as the file's blocks" in r.stdout
    assert "native_ggml" in r.stdout


def test_kquantize_writes_ggml_blocks():
    """The tests' own K-quant writer lays blocks out as ggml does: gguf-py reads its blocks back near the data."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    x = np.random.default_rng(4).standard_normal((8, 512)).astype(np.float32)
    for kind, tol in (("Q4_K", 0.3), ("Q5_K", 0.15), ("Q6_K", 0.08)):
        y = dequantize(kquantize(x, kind), GGMLQuantizationType[kind]).reshape(x.shape)
        assert np.abs(y - x).max() < tol, kind

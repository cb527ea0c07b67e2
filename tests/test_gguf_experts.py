"""GGUF MoE files' stacked experts (`ffn_{gate,up,down}_exps`) at Q8_0 / Q4_0 stay the file's blocks, in a
`quant.experts.QuantExperts` whose blocks are hyserve's own int8 / int4 of the HF folder's experts: a file written by
llama.cpp's converter then serves as its folder under --quantization int8, logit for logit, cache on as off."""

import json
import shutil

import pytest
import torch

pytest.importorskip("gguf")

from hyserve.models.runtime import ModelRuntime  # noqa: E402
from hyserve.quant.experts import QuantExperts  # noqa: E402

from .gguf_files import convert, requantize  # noqa: E402
from .test_engine_cache import SCRIPT, run_chat  # noqa: E402
from .test_gguf import _logits, llama_cpp_converter  # noqa: E402,F401
from .test_gguf_hybrid import _blocks  # noqa: E402

# Each folder as the real models are made, so that every weight keeps its blocks:
VARIANTS = {
    # value heads 32 wide (real Qwen3.5: 128): the converter's value-head reorder of out_proj moves whole blocks
    "qwen3_5_moe": dict(linear_key_head_dim=32, linear_value_head_dim=32),
    # a real Nemotron-H MoE has no dense MLP blocks (llama.cpp reads a zero-width FFN as a Mamba block); its
    # experts have no gate (up_proj, then relu^2)
    "nemotron_h": dict(layers_block_type=["linear_attention", "full_attention", "moe", "linear_attention", "moe"]),
}


@pytest.fixture(scope="module")
def folders(model_dirs, tmp_path_factory):
    """arch -> a tiny folder of that family with VARIANTS[arch] (random-init weights)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    built = {}

    def get(arch):
        if arch not in built:
            src, out = model_dirs[arch], tmp_path_factory.mktemp(f"{arch}-experts")
            for f in src.iterdir():
                if f.name not in ("config.json", "model.safetensors"):
                    shutil.copy(f, out / f.name)
            (out / "config.json").write_text(json.dumps(json.loads((src / "config.json").read_text()) | VARIANTS[arch]))
            torch.manual_seed(2)  # norms as initialised: Qwen3.5's (1 + w) - 1 is exact for w = 0 only
            AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(out)).save_pretrained(out)
            built[arch] = out
        return built[arch]

    return get


@pytest.fixture(scope="module")
def converted(llama_cpp_converter, folders, tmp_path_factory):  # noqa: F811 (the imported fixture)
    """(arch, outtype) -> the folder through llama.cpp's convert_hf_to_gguf.py (once)."""
    done = {}

    def get(arch, outtype):
        if (arch, outtype) not in done:
            out = tmp_path_factory.mktemp("gguf") / f"{arch}-{outtype}.gguf"
            extra = ("--no-mtp",) if arch.startswith("qwen") else ()
            done[arch, outtype] = convert(llama_cpp_converter, folders(arch), out, outtype, *extra)
        return done[arch, outtype]

    return get


@pytest.fixture(scope="module")
def quantized(folders):
    """(arch, scheme) -> the folder served with --quantization scheme (loaded once)."""
    done = {}

    def get(arch, scheme):
        if (arch, scheme) not in done:
            done[arch, scheme] = ModelRuntime.load(folders(arch), device="cpu", quantization=scheme)
        return done[arch, scheme]

    return get


def _experts(model) -> dict[str, tuple[torch.Tensor, ...]]:
    return {n: (m.up_qs, m.up_d, m.down_qs, m.down_d) for n, m in model.named_modules() if isinstance(m, QuantExperts)}


def _same_blocks(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for name, tensors in got.items():
        assert all(torch.equal(a, b) for a, b in zip(tensors, want[name], strict=True)), name


@pytest.mark.parametrize("arch", VARIANTS)
def test_a_q8_0_files_experts_are_its_folders_at_int8(converted, quantized, make_service, arch):
    rt = ModelRuntime.load(converted(arch, "q8_0"), device="cpu", quantization="int8")  # weight-only: int8's numbers
    int8 = quantized(arch, "int8")
    kept = _experts(rt.model)
    assert len(kept) >= 2
    _same_blocks(kept, _experts(int8.model))  # llama.cpp's Q8_0 of each expert's slice is hyserve's int8 of it
    _same_blocks(_blocks(rt.model), _blocks(int8.model))  # and so is every linear layer's
    loaded = rt.gguf_tensors
    assert not loaded.why and loaded.experts == {"Q8_0": 2 * len(kept)}
    assert f"kept quantized as the file's blocks ({2 * len(kept)} of them stacked expert weights" in loaded.describe()
    # the same blocks (above) and float weights, so the same logits up to the last bit: PyTorch's float32 products
    # may sum in another order for tensors laid out apart (3e-8 of 0.4 on a Zen 4 EPYC; bit for bit on a Zen 3)
    torch.testing.assert_close(_logits(rt), _logits(int8), rtol=1e-6, atol=1e-6)
    assert rt.kernels.status.get("native_int8") == int8.kernels.status.get("native_int8")
    on = run_chat(make_service(arch, model_dir=rt.model_dir, quantization="int8"), SCRIPT[:2])
    off = run_chat(make_service(arch, model_dir=rt.model_dir, quantization="int8", cache_enabled=False), SCRIPT[:2])
    assert [t[0] for t in on] == [t[0] for t in off] and on[1][1] > 0 and all(t[1] == 0 for t in off)


def test_q4_0_experts_up_before_gate_and_a_fallback(converted, quantized, folders, tmp_path):
    """Q4_0 experts written up before gate are assembled as gate rows then up (hyserve's int4 of them); experts
    whose down_proj is of another type are dequantized, both weights, and the start-up line says why."""
    from gguf import GGMLQuantizationType as Q

    f32 = converted("qwen3_5_moe", "f32")
    q4 = requantize(f32, tmp_path / "q4.gguf", lambda name, shape: Q.Q4_0 if "_exps" in name else None, reverse=True)
    rt = ModelRuntime.load(q4, device="cpu", quantization="int4")  # weight-only: the experts' rows not interleaved
    _same_blocks(_experts(rt.model), _experts(quantized("qwen3_5_moe", "int4").model))
    assert rt.gguf_tensors.kept == rt.gguf_tensors.experts == {"Q4_0": 2 * len(_experts(rt.model))}

    def mixed(name, shape):
        return None if "_exps" not in name else Q.Q5_0 if "down" in name else Q.Q8_0

    rt = ModelRuntime.load(requantize(f32, tmp_path / "mixed.gguf", mixed), device="cpu")
    assert not _experts(rt.model) and not rt.gguf_tensors.kept and rt.gguf_tensors.converted["Q8_0"] == 2 * 4
    line = rt.gguf_tensors.describe()
    assert line.startswith("none kept quantized")
    assert line.endswith(
        "(the quantized ones: 4 of stacked experts in Q5_0 (quant.experts holds Q8_0 / Q4_0 only); 4 of stacked "
        "experts whose other weight is not Q8_0/Q4_0)"
    )
    folder = ModelRuntime.load(folders("qwen3_5_moe"), device="cpu")
    want, got = _logits(folder), _logits(rt)
    assert (got - want).abs().max() < 0.05 * want.abs().max()


def test_hyserve_env_says_the_experts_are_kept(converted):
    from hyserve.env import report

    lines = report(str(converted("qwen3_5_moe", "q8_0"))).splitlines()
    gguf_line = next(line for line in lines if line.startswith("gguf: qwen3_5_moe-q8_0.gguf"))
    assert "kept quantized as the file's blocks (8 of them stacked expert weights, in quant.experts)" in gguf_line
    assert "experts: hyserve's loop over the quantized experts (quant.experts)" in lines

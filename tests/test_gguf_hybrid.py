"""GGUF files of the hybrid families hyserve loads itself (`hyserve.gguf.loader`): Qwen3.5 (dense, MoE) and Qwen3-Next
files written by llama.cpp's own converter serve as their HF folder (the same logits; cache on == cache off), and Q8_0 /
Q4_0 weights stay the file's blocks, which are the blocks hyserve's own int8 / int4 make of the HF weights."""

import subprocess
import sys

import pytest
import torch

pytest.importorskip("gguf")

from hyserve import gguf  # noqa: E402
from hyserve.models.preflight import check_model_dir  # noqa: E402
from hyserve.models.runtime import ModelRuntime  # noqa: E402
from hyserve.quant.layout import QuantEmbedding, QuantLinear  # noqa: E402

from .gguf_files import convert as run_converter  # noqa: E402
from .gguf_files import requantize, write_header_only  # noqa: E402
from .test_engine_cache import SCRIPT, run_chat  # noqa: E402
from .test_gguf import MESSAGES, _cli, _logits, _refused, llama_cpp_converter  # noqa: E402,F401

ARCHES = {"qwen3_5": "qwen35", "qwen3_5_moe": "qwen35moe", "qwen3_next": "qwen3next"}


@pytest.fixture(scope="module")
def converted(llama_cpp_converter, model_dirs, tmp_path_factory):  # noqa: F811 (the imported fixture)
    """convert(arch, outtype): the tiny `arch` folder through llama.cpp's converter (written once)."""
    made = {}

    def convert(arch: str, outtype: str):
        if (arch, outtype) not in made:
            out = tmp_path_factory.mktemp("gguf") / f"{arch}-{outtype}.gguf"
            run_converter(llama_cpp_converter, model_dirs[arch], out, outtype, "--no-mtp")
            made[arch, outtype] = out
        return made[arch, outtype]

    return convert


def _blocks(model) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each quantized linear layer's and embedding's values and scales, row after row (a file's Q8_0 / Q4_0 blocks
    under the default int8-activation products are held interleaved: `layout.interleave_`)."""
    from hyserve.quant.layout import _rows

    return {
        name: _rows(m.qs, m.d) if m.interleaved else (m.qs, m.d)
        for name, m in model.named_modules()
        if isinstance(m, (QuantLinear, QuantEmbedding))
    }


@pytest.mark.parametrize("arch", ARCHES)
def test_an_f32_file_serves_its_folder_exactly(converted, runtimes, arch):
    path = converted(arch, "f32")
    info = gguf.inspect(path)
    assert (info.architecture, info.model_type) == (ARCHES[arch], runtimes(arch).model.config.model_type)
    folder, rt = runtimes(arch), ModelRuntime.load(path, device="cpu")
    assert rt.render_chat(MESSAGES, True) == folder.render_chat(MESSAGES, True)  # tokenizer and template from GGUF
    assert rt.eos_token_ids == folder.eos_token_ids and rt.max_model_len == folder.max_model_len
    assert rt.kernels.status == folder.kernels.status
    want = folder.model.state_dict()
    assert {k: v.shape for k, v in rt.model.state_dict().items()} == {k: v.shape for k, v in want.items()}
    assert all(torch.equal(v, want[k]) for k, v in rt.model.state_dict().items())  # every transform undone
    assert torch.equal(_logits(rt), _logits(folder))
    assert (
        rt.gguf_tensors.describe() == f"none kept quantized; {sum(info.tensor_types.values())} F32 dequantized "
        "to float32"
    )


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_next"])  # Qwen3.5 MoE: the same two transforms together
def test_a_q8_0_file_keeps_its_blocks_and_serves_cache_on_as_off(converted, model_dirs, runtimes, make_service, arch):
    path = converted(arch, "q8_0")
    rt = ModelRuntime.load(path, device="cpu")
    int8 = ModelRuntime.load(model_dirs[arch], device="cpu", quantization="int8")
    kept, ours = _blocks(rt.model), _blocks(int8.model)
    # every linear layer but Qwen3.5's out_proj (its value heads were reordered across blocks, so it is
    # dequantized): the head, the embedding, attention, Gated DeltaNet and MLP / shared-expert projections
    out_proj = {n for n in ours if n.endswith("linear_attn.out_proj")} if arch == "qwen3_5" else set()
    assert set(kept) == set(ours) - out_proj and len(kept) >= 10
    for name, (qs, d) in kept.items():  # llama.cpp's Q8_0 of the HF weight is hyserve's int8 of it
        assert torch.equal(qs, ours[name][0]) and torch.equal(d, ours[name][1]), name
    # and Qwen3-Next's experts (gate_up_proj, down_proj of its 4 MoE layers: tests/test_gguf_experts.py)
    experts = 2 * 4 if arch == "qwen3_next" else 0
    assert rt.gguf_tensors.kept == {"Q8_0": len(kept) + experts} and rt.gguf_tensors.experts.total() == experts
    weight_only = ModelRuntime.load(path, device="cpu", quantization="int8")  # the folder's int8 numbers
    assert weight_only.kernels.status.get("native_int8") == int8.kernels.status.get("native_int8")
    assert rt.kernels.on("native_a8")  # the default: int8-activation products, as w8a8's
    want, got = _logits(int8), _logits(weight_only)
    if arch == "qwen3_next":  # every weight the file's blocks, which are int8's
        assert torch.equal(got, want)
    else:  # not equal: Qwen3.5's out_proj is float here
        assert (got - want).abs().max() < 0.005 * want.abs().max()
    on = run_chat(make_service(arch, model_dir=path, quantization="int8"), SCRIPT[:3])
    off = run_chat(make_service(arch, model_dir=path, quantization="int8", cache_enabled=False), SCRIPT[:3])
    assert [t[0] for t in on] == [t[0] for t in off] and on[2][1] > 0 and all(t[1] == 0 for t in off)


def test_a_q8_0_file_under_w8a8_rounds_the_inputs_of_its_kept_blocks(converted, model_dirs):
    """`--quantization w8a8` on a Q8_0 file: its kept blocks (Qwen3-Next's experts among them) round their inputs
    and take the int8-activation products, as the folder's w8a8 does; every weight is the file's blocks, which are
    int8's, so the logits are the folder's exactly, and not the file's without w8a8."""
    from hyserve.quant import native as qnative
    from hyserve.quant.experts import quantized_linears

    path = converted("qwen3_next", "q8_0")
    rt = ModelRuntime.load(path, device="cpu", quantization="w8a8")
    layers = quantized_linears(rt.model)
    assert len(layers) >= 10 and all(m.rounds_activations for m in layers)
    assert rt.kernels.on(qnative.A8_KERNEL), rt.kernels.status
    assert all(isinstance(m.native, qnative.A8Products) for m in layers)
    folder = ModelRuntime.load(model_dirs["qwen3_next"], device="cpu", quantization="w8a8")
    assert torch.equal(_logits(rt), _logits(folder))
    # the file's default: the same (its blocks computed as llama.cpp computes them), not weight-only int8's
    assert torch.equal(_logits(rt), _logits(ModelRuntime.load(path, device="cpu")))
    assert not torch.equal(_logits(rt), _logits(ModelRuntime.load(path, device="cpu", quantization="int8")))


def test_q4_0_and_q5_0_blocks_are_kept_and_float_tensors_quantized_on_request(converted, model_dirs, tmp_path):
    """Q4_0 stays as the file's nibbles (hyserve's int4 of the weight), Q5_0 as the file's blocks
    (`quant.ggml_blocks`); with --quantization int8 both stay and only what the file holds in float is quantized;
    an embedding in Q4_0 stays a quantized embedding."""
    from gguf import GGMLQuantizationType as Q

    from hyserve.quant.ggml_blocks import GgmlLinear

    def qtype(name, shape):
        if len(shape) != 2 or shape[1] % 32 or "ssm_out" in name or name == "output.weight":
            return None
        return Q.Q5_0 if "ffn_down" in name else Q.Q4_0

    path = requantize(converted("qwen3_5", "f32"), tmp_path / "q4.gguf", qtype)
    rt = ModelRuntime.load(path, device="cpu")
    int4 = ModelRuntime.load(model_dirs["qwen3_5"], device="cpu", quantization="int4")
    kept, ours = _blocks(rt.model), _blocks(int4.model)
    assert isinstance(rt.model.get_input_embeddings(), QuantEmbedding)
    assert not any(n.endswith(("mlp.down_proj", "out_proj")) or n == "lm_head" for n in kept)
    assert len(kept) >= 10
    for name, (qs, d) in kept.items():
        assert qs.dtype == torch.uint8 and torch.equal(qs, ours[name][0]) and torch.equal(d, ours[name][1]), name
    assert rt.gguf_tensors.kept == {"Q4_0": len(kept), "Q5_0": 4} and "Q5_0" not in rt.gguf_tensors.converted
    assert all(isinstance(layer.mlp.down_proj, GgmlLinear) for layer in rt.model.model.layers)
    assert torch.isfinite(_logits(rt)).all()
    requant = ModelRuntime.load(path, device="cpu", quantization="int8")
    down = requant.model.model.layers[0].mlp.down_proj
    assert isinstance(down, GgmlLinear) and torch.equal(down.blocks, rt.model.model.layers[0].mlp.down_proj.blocks)
    up = "model.layers.0.mlp.up_proj"
    assert all(torch.equal(a, b) for a, b in zip(_blocks(requant.model)[up], _blocks(rt.model)[up]))
    assert requant.quantization.layers == 3 + 1  # the out_projs and the head, F32 in the file


def test_env_says_what_was_kept_and_what_was_converted(converted):
    r = _cli("env", str(converted("qwen3_5", "q8_0")))
    assert r.returncode == 0, r.stderr
    assert (
        "gguf: qwen3_5-q8_0.gguf, architecture qwen35, tensors 33 Q8_0, 23 F32: 30 Q8_0 kept quantized as the "
        "file's blocks; 23 F32, 3 Q8_0 dequantized to float32 (the quantized ones: 3 whose conversion moves "
        "weights within blocks or changes them)"
    ) in r.stdout


def test_bad_hybrid_files_are_refused_with_one_line(converted, tmp_path):
    import numpy as np
    from gguf import GGMLQuantizationType as Q

    data = converted("qwen3_5", "q8_0").read_bytes()
    (cut := tmp_path / "cut.gguf").write_bytes(data[: len(data) * 2 // 3])
    assert "is truncated" in _refused(cut)
    q81 = write_header_only(tmp_path / "q81.gguf", "qwen35", raw=(np.zeros((2, 40), np.uint8), Q.Q8_1, None))
    assert "tensor type(s) Q8_1 cannot be dequantized by gguf" in _refused(q81)
    msg = _refused(write_header_only(tmp_path / "rwkv.gguf", "rwkv6"))
    assert "GGUF architecture 'rwkv6' is not supported; supported: " in msg and "qwen35, qwen35moe, qwen3next" in msg
    # a tensor the family has no place for: refused when loading, one line, exit 2
    odd = requantize(converted("qwen3_5", "f32"), tmp_path / "odd.gguf", lambda name, shape: None)
    rename = odd.read_bytes().replace(b"blk.0.ssm_out.weight", b"blk.0.ssm_xyz.weight")
    (odd := tmp_path / "odd.gguf").write_bytes(rename)
    r = _cli("serve", str(odd), "--port", "0")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "tensor blk.0.ssm_xyz.weight (F32) has no place in a qwen3_5_text model" in r.stderr


def test_a_split_file_serves_as_the_whole(converted, runtimes, tmp_path):
    """llama.cpp's gguf-split parts (the metadata in the first): served from any part's name, or their folder;
    a missing part is named."""
    first = requantize(converted("qwen3_5", "f32"), tmp_path / "m.gguf", lambda name, shape: None, split_max_tensors=20)
    parts = sorted(tmp_path.glob("m-*-of-00003.gguf"))
    assert [p.name for p in parts] == [f"m-0000{i}-of-00003.gguf" for i in (1, 2, 3)] and first == parts[0]
    assert check_model_dir(parts[1]) == [] and gguf.gguf_path(tmp_path) == first
    rt = ModelRuntime.load(parts[2], device="cpu")
    assert torch.equal(_logits(rt), _logits(runtimes("qwen3_5")))
    parts[1].unlink()
    for path in (first, tmp_path):
        assert "split in 3 files, and 1 of them is missing: m-00002-of-00003.gguf" in _refused(path)


def test_a_q8_0_file_of_block_wide_heads_is_its_folder_at_int8(
    llama_cpp_converter,  # noqa: F811 (the imported fixture)
    model_dirs,
    tmp_path,
):
    """Value heads 32 wide (real Qwen3.5: 128): the reordered out_proj moves whole blocks, so every linear layer
    keeps the file's blocks and the model is the folder's under --quantization int8, logit for logit."""
    import shutil

    from transformers import AutoConfig, AutoModelForCausalLM

    src = model_dirs["qwen3_5"]
    config = AutoConfig.from_pretrained(src)
    config.linear_key_head_dim = config.linear_value_head_dim = 32
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "hf")
    for f in src.iterdir():
        if f.name != "config.json" and not f.name.endswith(".safetensors"):
            shutil.copy(f, tmp_path / "hf" / f.name)
    out = tmp_path / "wide-q8_0.gguf"
    r = subprocess.run(
        [
            sys.executable,
            "convert_hf_to_gguf.py",
            str(tmp_path / "hf"),
            "--outtype",
            "q8_0",
            "--no-mtp",
            "--outfile",
            str(out),
        ],
        cwd=llama_cpp_converter,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    rt = ModelRuntime.load(out, device="cpu", quantization="int8")
    int8 = ModelRuntime.load(tmp_path / "hf", device="cpu", quantization="int8")
    assert set(_blocks(rt.model)) == set(_blocks(int8.model)) and not rt.gguf_tensors.why
    assert torch.equal(_logits(rt), _logits(int8))


def test_mtp_layers_are_dropped(converted, runtimes, tmp_path):
    """A file with Qwen3.5's multi-token-prediction layer (converted without --no-mtp: one more block, counted by
    nextn_predict_layers) serves the HF model, which has no place for it."""
    import numpy as np

    mtp = {
        f"blk.4.{name}": np.ones(shape, np.float32)
        for name, shape in (
            ("nextn.eh_proj.weight", (64, 128)),
            ("nextn.enorm.weight", (64,)),
            ("attn_norm.weight", (64,)),
            ("attn_q.weight", (128, 64)),
        )
    }
    path = requantize(
        converted("qwen3_5", "f32"),
        tmp_path / "mtp.gguf",
        lambda name, shape: None,
        meta={
            "qwen35.block_count": 5,
            "qwen35.nextn_predict_layers": 1,
            "qwen35.attention.recurrent_layers": [True, True, True, False, False],
        },
        extra=mtp,
    )
    rt = ModelRuntime.load(path, device="cpu")
    assert rt.model.config.num_hidden_layers == 4 and rt.model.config.layer_types[3] == "full_attention"
    assert torch.equal(_logits(rt), _logits(runtimes("qwen3_5")))

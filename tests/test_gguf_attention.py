"""GGUF files of the plain attention models (`llama`, `qwen2`, `qwen3`) and LFM2 (`lfm2`), written by llama.cpp's own
converter from a tiny HF folder, served by hyserve's loader as that folder: f32 files with its exact weights and
logits; Q8_0 files keeping the file's blocks, which are hyserve's int8 of the folder's weights, so the logits are
the folder's under --quantization int8; the chat the same with the cache on and off; split files as the whole."""

import json
import shutil

import numpy as np
import pytest
import torch

pytest.importorskip("gguf")

from hyserve import gguf  # noqa: E402
from hyserve.gguf.families import attention  # noqa: E402
from hyserve.gguf.file import GGUFError  # noqa: E402
from hyserve.gguf.loader import file_metadata  # noqa: E402
from hyserve.models.runtime import ModelRuntime  # noqa: E402

from .gguf_files import converted_once, requantize  # noqa: E402
from .test_engine_cache import SCRIPT, run_chat  # noqa: E402
from .test_gguf import MESSAGES, _logits, _refused, llama_cpp_converter  # noqa: E402, F401
from .test_gguf_hybrid import _blocks  # noqa: E402

ARCHES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "lfm2": "lfm2"}  # folder -> GGUF architecture
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
# make-tiny-model has no llama or qwen2: those are the tiny qwen3's sizes and tokenizer. llama: untied, biased q/k
# (so that the q/k permutation of biases is checked too), Llama 3's rope scaling (a `rope_freqs` tensor in the file)
NEW = {
    "llama": dict(tie_word_embeddings=False, attention_bias=True, rope_parameters=LLAMA3_ROPE),
    "qwen2": dict(tie_word_embeddings=True),
}
_SIZES = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "max_position_embeddings",
    "rms_norm_eps",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
)


@pytest.fixture(scope="module")
def folders(model_dirs, tmp_path_factory):
    """arch -> a tiny random-init folder of that family, its norms and biases away from their init values (so that
    one left out or misplaced shows)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    built = {}

    def get(arch):
        if arch not in built:
            src, out = model_dirs["qwen3" if arch in NEW else arch], tmp_path_factory.mktemp(f"{arch}-folder")
            if arch in NEW:
                cfg = json.loads((src / "config.json").read_text())
                config = AutoConfig.for_model(arch, **{k: cfg[k] for k in _SIZES if k in cfg}, **NEW[arch])
            else:
                config = AutoConfig.from_pretrained(src)
            torch.manual_seed(1)
            model = AutoModelForCausalLM.from_config(config)
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if "norm" in name and name.endswith("weight"):
                        p.uniform_(0.5, 1.5)
                    elif name.endswith("bias"):
                        p.normal_(0, 0.5)
            model.save_pretrained(out)
            for f in src.iterdir():
                if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
                    shutil.copy(f, out / f.name)
            built[arch] = out
        return built[arch]

    return get


@pytest.fixture(scope="module")
def converted(llama_cpp_converter, folders, tmp_path_factory):  # noqa: F811 (the imported fixture)
    """(arch, outtype) -> the folder converted by llama.cpp's convert_hf_to_gguf.py (once)."""
    return converted_once(llama_cpp_converter, folders, tmp_path_factory)


@pytest.fixture(scope="module")
def loaded(folders):
    """(arch, quantization) -> the folder's runtime (once)."""
    done = {}

    def get(arch, quantization=None):
        if (arch, quantization) not in done:
            done[arch, quantization] = ModelRuntime.load(folders(arch), device="cpu", quantization=quantization)
        return done[arch, quantization]

    return get


@pytest.mark.parametrize("arch", ARCHES)
def test_an_f32_file_serves_its_folder_exactly(converted, loaded, arch):
    path = converted(arch)
    info = gguf.inspect(path)
    assert (info.architecture, info.model_type) == (ARCHES[arch], arch)
    folder, rt = loaded(arch), ModelRuntime.load(path, device="cpu")
    assert rt.render_chat(MESSAGES, True) == folder.render_chat(MESSAGES, True)  # tokenizer and template from GGUF
    assert rt.eos_token_ids == folder.eos_token_ids and rt.max_model_len == folder.max_model_len
    assert rt.model.config.rope_parameters == folder.model.config.rope_parameters  # llama: Llama 3's, from rope_freqs
    mine, theirs = rt.model.state_dict(), folder.model.state_dict()
    assert mine.keys() == theirs.keys()
    assert all(torch.equal(mine[name], w) for name, w in theirs.items())  # llama: q/k rows and biases unpermuted
    assert torch.equal(_logits(rt), _logits(folder))
    count = sum(info.tensor_types.values())
    assert rt.gguf_tensors.describe() == f"none kept quantized; {count} F32 dequantized to float32"


@pytest.mark.parametrize("arch", ARCHES)
def test_a_q8_0_file_is_its_folder_at_int8_and_serves_cache_on_as_off(converted, loaded, make_service, arch):
    """Every linear weight and the embedding stay the file's blocks (not dequantized), the very blocks of hyserve's
    int8 of the folder's weights (llama's permuted q/k rows: whole rows moved), so the logits are the folder's under
    --quantization int8."""
    path = converted(arch, "q8_0")
    rt, int8 = ModelRuntime.load(path, device="cpu", quantization="int8"), loaded(arch, "int8")  # weight-only
    kept, ours = _blocks(rt.model), _blocks(int8.model)
    assert set(kept) == set(ours) and {"model.embed_tokens", "lm_head"} <= set(kept)
    assert any(name.endswith("self_attn.q_proj") for name in kept) and len(kept) >= 2 * 7
    for name, (qs, d) in kept.items():
        assert qs.dtype == torch.int8 and torch.equal(qs, ours[name][0]) and torch.equal(d, ours[name][1]), name
    tied = rt.model.config.tie_word_embeddings  # the head shares the embedding's blocks: one tensor in the file
    assert rt.gguf_tensors.kept == {"Q8_0": len(kept) - tied} and not rt.gguf_tensors.why
    assert torch.equal(_logits(rt), _logits(int8))
    on = run_chat(make_service("qwen3", model_dir=path, quantization="int8"), SCRIPT[:3])
    off = run_chat(make_service("qwen3", model_dir=path, quantization="int8", cache_enabled=False), SCRIPT[:3])
    assert [t[0] for t in on] == [t[0] for t in off] and on[2][1] > 0 and all(t[1] == 0 for t in off)


def test_a_split_file_with_q4_0_and_other_types(converted, loaded, tmp_path):
    """A llama file split in parts (as gguf-split writes them) serves as the whole; its permuted q/k rows in Q4_0
    stay the file's nibbles (hyserve's int4 of the folder's), Q5_0 the file's blocks (`quant.ggml_blocks`, kept with
    --quantization int8 too), a missing part is named."""
    from gguf import GGMLQuantizationType as Q

    from hyserve.quant.ggml_blocks import GgmlLinear

    def qtype(name, shape):
        if len(shape) != 2 or shape[1] % 32:
            return None
        return Q.Q4_0 if "attn_q." in name or "attn_k." in name else Q.Q5_0 if "ffn_down" in name else Q.Q8_0

    first = requantize(converted("llama"), tmp_path / "m.gguf", qtype, split_max_tensors=8)
    parts = sorted(tmp_path.glob("m-*.gguf"))
    assert len(parts) >= 3 and first == parts[0]
    rt = ModelRuntime.load(parts[1], device="cpu")
    kept, int4, int8 = _blocks(rt.model), _blocks(loaded("llama", "int4").model), _blocks(loaded("llama", "int8").model)
    assert rt.gguf_tensors.kept == {"Q4_0": 4, "Q8_0": len(kept) - 4, "Q5_0": 2} and not rt.gguf_tensors.why
    for name, (qs, d) in kept.items():
        ours = int4[name] if name.endswith(("q_proj", "k_proj")) else int8[name]
        assert torch.equal(qs, ours[0]) and torch.equal(d, ours[1]), name
    assert not any(name.endswith("down_proj") for name in kept)
    assert torch.isfinite(_logits(rt)).all()
    requant = ModelRuntime.load(first, device="cpu", quantization="int8")
    down = requant.model.model.layers[0].mlp.down_proj
    assert isinstance(down, GgmlLinear) and down.kind == "Q5_0" and not down.rounds_activations  # weight-only
    parts[1].unlink()
    assert f"1 of them is missing: {parts[1].name}" in _refused(first)


def test_rope_scaling_is_read_back(converted):
    """Llama 3's factors (`rope_freqs`) become its rope_parameters, other factors are refused; linear and YaRN
    scaling are metadata."""
    from gguf import GGUFReader

    meta = file_metadata([GGUFReader(converted("llama"))])
    assert attention.config(meta)["rope_parameters"] == LLAMA3_ROPE
    with pytest.raises(GGUFError, match="rope_freqs are not Llama 3's rope scaling"):
        attention.config(meta | {"rope_freqs": meta["rope_freqs"] * np.float32(1.01)})
    plain = {k: v for k, v in meta.items() if k != "rope_freqs"}
    linear = plain | {"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0}
    assert attention.config(linear)["rope_parameters"] == {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}
    yarn = plain | {
        "llama.rope.scaling.type": "yarn",
        "llama.rope.scaling.factor": 4.0,
        "llama.rope.scaling.original_context_length": 32768,
    }
    assert attention.config(yarn)["rope_parameters"] == {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 32768,
    }
    with pytest.raises(GGUFError, match="longrope rope scaling"):
        attention.config(plain | {"llama.rope.scaling.type": "longrope"})
    with pytest.raises(GGUFError, match="experts"):
        attention.config(plain | {"tensor_shapes": {"blk.0.ffn_gate_exps.weight": (4, 8, 8)}})

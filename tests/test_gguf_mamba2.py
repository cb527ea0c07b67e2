"""GGUF files of the Mamba2 hybrids (Nemotron-H, Granite 4.0-H, Falcon-H1) and of pure Mamba2, written by llama.cpp's
own converter from a tiny HF folder, serve as that folder: same logits, and the same chat cache on and off."""

import json
import shutil

import pytest
import torch

pytest.importorskip("gguf")

from hyserve.gguf.families import falcon_h1, granite_hybrid, nemotron_h  # noqa: E402
from hyserve.gguf.families._common import unpermute  # noqa: E402
from hyserve.gguf.file import GGUFError  # noqa: E402
from hyserve.gguf.loader import file_metadata  # noqa: E402
from hyserve.models.runtime import ModelRuntime  # noqa: E402

from .gguf_files import _permute, converted_once  # noqa: E402
from .test_engine_cache import SCRIPT, run_chat  # noqa: E402
from .test_gguf import MESSAGES, _logits, llama_cpp_converter  # noqa: E402, F401
from .test_gguf_experts import _experts, _same_blocks  # noqa: E402
from .test_gguf_hybrid import _blocks  # noqa: E402

# Each folder as the real models are made, where the tiny default is not:
VARIANTS = {
    # a real Nemotron-H MoE has no dense MLP blocks (llama.cpp reads a zero-width FFN as a Mamba block)
    "nemotron_h": dict(layers_block_type=["linear_attention", "full_attention", "moe", "linear_attention", "moe"]),
    # Granite's µP multipliers, which the file keeps as metadata
    "granitemoehybrid": dict(
        attention_multiplier=0.3, embedding_multiplier=3.0, residual_multiplier=0.5, logits_scaling=2.0
    ),
    # Falcon-H1's µP multipliers, which the converter folds into the weights; its configs name head_dim (the
    # converter needs it), and its Mamba norm runs after the gate (as llama.cpp's does)
    "falcon_h1": dict(
        head_dim=16,
        mamba_rms_norm=True,
        mamba_norm_before_gate=False,
        embedding_multiplier=2.0,
        lm_head_multiplier=0.5,
        attention_in_multiplier=0.75,
        attention_out_multiplier=1.5,
        key_multiplier=0.5,
        ssm_in_multiplier=1.25,
        ssm_out_multiplier=0.8,
        ssm_multipliers=[0.5, 1.5, 0.75, 1.25, 2.0],
        mlp_multipliers=[0.6, 1.4],
    ),
    "mamba2": {},
    "granitemoehybrid-dense": dict(num_local_experts=0),  # as Granite 4.0-H-Micro: the shared MLP only
}


@pytest.fixture(scope="module")
def converter(llama_cpp_converter):  # noqa: F811
    """The converter, reading Granite's layer types as transformers 5 spells them: it looks for "attention"
    only, so with the installed transformers (which reads "attention" as "full_attention") it would write
    every Granite layer as Mamba (see test_a_file_whose_layer_types_were_misread_is_refused)."""
    granite = llama_cpp_converter / "conversion" / "granite.py"
    text = granite.read_text()
    assert 'if typ == "attention"' in text
    granite.write_text(text.replace('if typ == "attention"', 'if typ in ("attention", "full_attention")'))
    return llama_cpp_converter


@pytest.fixture(scope="module")
def folders(model_dirs, tmp_path_factory):
    """name -> a tiny folder of VARIANTS[name]'s family ("arch" or "arch-kind") with its config (random-init
    weights, the tiny tokenizer)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    built = {}

    def get(arch):
        if arch not in built:
            src, out = model_dirs[arch.split("-")[0]], tmp_path_factory.mktemp(f"{arch}-variant")
            for f in src.iterdir():
                if f.name not in ("config.json", "model.safetensors"):
                    shutil.copy(f, out / f.name)
            cfg = json.loads((src / "config.json").read_text()) | VARIANTS[arch]
            (out / "config.json").write_text(json.dumps(cfg))
            torch.manual_seed(1)
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(out))
            with torch.no_grad():  # norms away from 1, so that a norm left out or misplaced shows
                for name, p in model.named_parameters():
                    if name.endswith("norm.weight"):
                        p.uniform_(0.5, 1.5)
            model.save_pretrained(out)
            built[arch] = out
        return built[arch]

    return get


@pytest.fixture(scope="module")
def converted(converter, folders, tmp_path_factory):
    """(arch, outtype) -> the folder converted by llama.cpp's convert_hf_to_gguf.py (once)."""
    return converted_once(converter, folders, tmp_path_factory)


@pytest.mark.parametrize(
    "arch, outtype",
    [
        ("nemotron_h", "f32"),
        ("granitemoehybrid", "f32"),
        ("granitemoehybrid-dense", "f32"),
        ("falcon_h1", "f32"),
        ("mamba2", "f32"),
        ("granitemoehybrid", "q8_0"),
    ],
)
def test_llama_cpp_converted_hybrids_serve_as_their_folder(converted, folders, make_service, arch, outtype):
    path = converted(arch, outtype)
    folder = ModelRuntime.load(folders(arch), device="cpu")
    rt = ModelRuntime.load(path, device="cpu", quantization="int8" if outtype == "q8_0" else None)  # weight-only
    assert rt.model.config.model_type == folder.model.config.model_type
    assert rt.render_chat(MESSAGES, True) == folder.render_chat(MESSAGES, True)
    want, got = _logits(folder), _logits(rt)
    if outtype == "q8_0":  # the Q8_0 blocks kept are hyserve's int8 of the HF weights, also where rows were moved
        assert (got - want).abs().max() < 0.05 * want.abs().max()  # (q/k) or joined (the shared MLP's gate, up)
        kept = _blocks(rt.model)
        int8 = ModelRuntime.load(folders(arch), device="cpu", quantization="int8")
        ours = _blocks(int8.model)
        assert {
            "model.layers.2.self_attn.q_proj",
            "model.layers.2.self_attn.k_proj",
            "model.layers.0.shared_mlp.input_linear",
            "model.layers.0.mamba.in_proj",
        } <= kept.keys()
        for name, (qs, d) in kept.items():
            assert torch.equal(qs, ours[name][0]) and torch.equal(d, ours[name][1]), name
        experts = _experts(rt.model)  # the stacked experts too (gate and up joined), in a QuantExperts
        assert len(experts) == 4
        _same_blocks(experts, _experts(int8.model))
        return  # (a q8_0 file's blocks serve a chat as in tests/test_gguf_hybrid.py)
    # float rounding only (A_log through exp and log, Falcon-H1's folded multipliers)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    if arch != "falcon_h1":
        # every weight back in place: these have no rotary embedding, so logits alone would not show q/k rows
        # left permuted alike (Falcon-H1's weights hold its folded multipliers: its logits are the proof)
        mine, theirs = rt.model.state_dict(), folder.model.state_dict()
        assert mine.keys() == theirs.keys()
        for name, w in theirs.items():
            torch.testing.assert_close(mine[name], w, rtol=1e-6, atol=0, msg=name)
    if "-" not in arch:  # (the dense Granite serves as the MoE one)
        on = run_chat(make_service(arch, model_dir=path), SCRIPT[:2])
        off = run_chat(make_service(arch, model_dir=path, cache_enabled=False), SCRIPT[:2])
        assert [t[0] for t in on] == [t[0] for t in off] and on[1][1] > 0 and all(t[1] == 0 for t in off)


def test_a_file_whose_layer_types_were_misread_is_refused(converted):
    """What the unpatched converter writes under transformers 5 (every head_count_kv 0, attention tensors
    anyway) is refused with one line, not loaded as a model of Mamba layers only."""
    from gguf import GGUFReader

    meta = file_metadata([GGUFReader(converted("granitemoehybrid"))])
    assert granite_hybrid.config(meta)["layer_types"][2] == "full_attention"
    meta["granitehybrid.attention.head_count_kv"] = [0, 0, 0, 0]
    with pytest.raises(GGUFError, match="block 2: its tensors and its metadata .* disagree"):
        granite_hybrid.config(meta)


def test_unpermute_undoes_the_converters_rotary_permutation():
    w = torch.randn(4 * 16, 8)
    assert torch.equal(unpermute(torch.from_numpy(_permute(w.numpy(), 4)), 4), w)
    assert not torch.equal(torch.from_numpy(_permute(w.numpy(), 4)), w)


def test_what_the_modules_cannot_load_is_refused_with_one_line():
    falcon = {"general.architecture": "falcon-h1", "tensor_shapes": {"blk.0.attn_q.bias": (64,)}}
    with pytest.raises(GGUFError, match=r"Falcon-H1 file with biases \(attn_q.bias\)"):
        falcon_h1.config(falcon)
    with pytest.raises(GGUFError, match="multi-token-prediction block .* --no-mtp"):
        nemotron_h.config({"general.architecture": "nemotron_h_moe", "nemotron_h_moe.nextn_predict_layers": 1})
    with pytest.raises(GGUFError, match="has no nemotron_h.block_count"):
        nemotron_h.config({"general.architecture": "nemotron_h"})


def test_rotary_over_part_of_the_head_is_refused(converted):
    """A Granite 4.0-H file (its multipliers in the metadata) with RoPE over part of each head, which Granite's HF
    model cannot do (a Bamba file, without them, loads as Bamba: tests/test_gguf_jamba_lfm2_bamba.py)."""
    from gguf import GGUFReader

    meta = file_metadata([GGUFReader(converted("granitemoehybrid"))])
    meta |= {"granitehybrid.rope.scaling.finetuned": True, "granitehybrid.rope.dimension_count": 8}
    with pytest.raises(GGUFError, match="rotary embedding over 8 of the 16 head dimensions"):
        granite_hybrid.config(meta)
    meta["granitehybrid.rope.dimension_count"] = 16
    assert granite_hybrid.config(meta)["position_embedding_type"] == "rope"


@pytest.mark.parametrize("arch, mlp", [("nemotron_h", "mlp"), ("nemotron_h_moe", "moe")])
def test_nemotron_h_layers_are_read_as_llama_cpp_reads_them(arch, mlp):
    meta = {
        "general.architecture": arch,
        f"{arch}.block_count": 4,
        f"{arch}.attention.head_count_kv": [0, 2, 0, 0],
        f"{arch}.feed_forward_length": [0, 0, 128, 0],
    }
    assert nemotron_h.layer_types(meta) == ["linear_attention", "full_attention", mlp, "linear_attention"]
    kinds = ["ssm_in", "attn_q", "ffn_up_exps" if mlp == "moe" else "ffn_up", "ssm_in"]
    meta["tensor_shapes"] = {f"blk.{i}.{kind}.weight": (8, 8) for i, kind in enumerate(kinds)}
    assert nemotron_h.layer_types(meta)[2] == mlp
    # a dense Nemotron-H converted under transformers 5: written as nemotron_h_moe, its MLP blocks of width 0
    meta |= {
        "general.architecture": "nemotron_h_moe",
        "nemotron_h_moe.block_count": 4,
        "nemotron_h_moe.attention.head_count_kv": [0, 2, 0, 0],
        "nemotron_h_moe.feed_forward_length": [0] * 4,
    }
    meta["tensor_shapes"] = {
        f"blk.{i}.{kind}.weight": (8, 8) for i, kind in enumerate(["ssm_in", "attn_q", "ffn_up", "ssm_in"])
    }
    with pytest.raises(
        GGUFError,
        match="block 2: its metadata makes it a linear_attention block, but the file has no ssm_in.weight there",
    ):
        nemotron_h.layer_types(meta)

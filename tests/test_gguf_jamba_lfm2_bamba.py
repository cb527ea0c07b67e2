"""GGUF files of Jamba, LFM2-MoE and Bamba, written by llama.cpp's own converter from a tiny HF folder, serve as that
folder: the same weights, the same logits, and the same chat with the cache on and off."""

import io
import json
import shutil

import pytest
import torch

pytest.importorskip("gguf")

from hyserve.gguf.families import granite_hybrid, jamba  # noqa: E402
from hyserve.gguf.file import GGUFError  # noqa: E402
from hyserve.gguf.loader import file_metadata  # noqa: E402
from hyserve.models.runtime import ModelRuntime  # noqa: E402

from .gguf_files import converted_once  # noqa: E402
from .test_engine_cache import SCRIPT, run_chat  # noqa: E402
from .test_gguf import MESSAGES, _logits, llama_cpp_converter  # noqa: E402, F401
from .test_gguf_experts import _experts, _same_blocks  # noqa: E402
from .test_gguf_hybrid import _blocks  # noqa: E402

# Each folder as the real models are made, where the tiny default is not:
VARIANTS = {
    "jamba": {},  # and a sentencepiece tokenizer (`_sentencepiece_tokenizer`), as Jamba's converter wants
    "lfm2_moe": dict(tie_word_embeddings=True),  # as LFM2-8B-A1B: llama.cpp's lfm2moe has no output tensor
    "bamba": dict(attn_rotary_emb=8),  # as Bamba-9B's config names it (half of each head)
}


def _sentencepiece_tokenizer(out) -> dict:
    """A tiny sentencepiece tokenizer (BPE, byte fallback, ChatML's tokens) in `out`: `tokenizer.model` for the
    converter (Jamba's reads only that or a Llama-BPE tokenizer.json), the same as a transformers tokenizer for
    the folder; the config keys that name its tokens."""
    import sentencepiece as spm
    from transformers import AutoTokenizer

    from hyserve.testing.tiny import _TRAINING_TEXT, CHATML_TEMPLATE, SPECIAL_TOKENS

    model = io.BytesIO()
    lines = [line for line in _TRAINING_TEXT.splitlines() if line.strip()]
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines * 4),
        model_writer=model,
        vocab_size=400,
        model_type="bpe",
        byte_fallback=True,
        user_defined_symbols=SPECIAL_TOKENS,
        hard_vocab_limit=False,
        character_coverage=1.0,
        minloglevel=2,
    )
    (out / "tokenizer.model").write_bytes(model.getvalue())
    (out / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizer"}))
    tok = AutoTokenizer.from_pretrained(out)
    tok.eos_token, tok.pad_token, tok.chat_template = "<|im_end|>", "<|endoftext|>", CHATML_TEMPLATE
    tok.save_pretrained(out)
    config = json.loads((out / "tokenizer_config.json").read_text())
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    # the converter marks these control tokens from here (transformers 5 keeps them in tokenizer.json only)
    config["added_tokens_decoder"] = {
        str(i): {"content": t, "special": True, "lstrip": False, "rstrip": False, "normalized": False}
        for t, i in ids.items()
    }
    config["add_bos_token"] = False
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return {
        "vocab_size": len(tok),
        "eos_token_id": ids["<|im_end|>"],
        "pad_token_id": ids["<|endoftext|>"],
        "bos_token_id": tok.bos_token_id,
    }


@pytest.fixture(scope="module")
def folders(model_dirs, tmp_path_factory):
    """arch -> a tiny folder of that family with VARIANTS[arch] (random-init weights, norms away from 1)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    built = {}

    def get(arch):
        if arch not in built:
            src, out = model_dirs[arch], tmp_path_factory.mktemp(f"{arch}-variant")
            cfg = json.loads((src / "config.json").read_text()) | VARIANTS[arch]
            if arch == "jamba":
                cfg |= _sentencepiece_tokenizer(out)
            else:
                for f in src.iterdir():
                    if f.name not in ("config.json", "model.safetensors"):
                        shutil.copy(f, out / f.name)
            (out / "config.json").write_text(json.dumps(cfg))
            torch.manual_seed(1)
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(out))
            with torch.no_grad():  # so that a norm left out or misplaced shows
                for name, p in model.named_parameters():
                    if "norm" in name and name.endswith("weight"):
                        p.uniform_(0.5, 1.5)
            model.save_pretrained(out)
            built[arch] = out
        return built[arch]

    return get


@pytest.fixture(scope="module")
def converted(llama_cpp_converter, folders, tmp_path_factory):  # noqa: F811 (the imported fixture)
    """(arch, outtype) -> the folder converted by llama.cpp's convert_hf_to_gguf.py (once)."""
    return converted_once(llama_cpp_converter, folders, tmp_path_factory)


@pytest.mark.parametrize("arch", list(VARIANTS))
def test_llama_cpp_converted_files_serve_as_their_folder(converted, folders, make_service, arch):
    path = converted(arch)
    folder, rt = ModelRuntime.load(folders(arch), device="cpu"), ModelRuntime.load(path, device="cpu")
    assert rt.model.config.model_type == folder.model.config.model_type == arch
    assert rt.render_chat(MESSAGES, True) == folder.render_chat(MESSAGES, True)  # tokenizer and template from GGUF
    assert rt.eos_token_ids == folder.eos_token_ids
    mine, theirs = rt.model.state_dict(), folder.model.state_dict()
    assert mine.keys() == theirs.keys()
    for name, w in theirs.items():  # every transform undone (A_log through exp and log: float rounding)
        torch.testing.assert_close(mine[name], w, rtol=1e-6, atol=0, msg=name)
    torch.testing.assert_close(_logits(rt), _logits(folder), rtol=1e-5, atol=1e-6)
    on = run_chat(make_service(arch, model_dir=path), SCRIPT[:2])
    off = run_chat(make_service(arch, model_dir=path, cache_enabled=False), SCRIPT[:2])
    assert [t[0] for t in on] == [t[0] for t in off] and on[1][1] > 0 and all(t[1] == 0 for t in off)


@pytest.mark.parametrize("arch", list(VARIANTS))
def test_a_q8_0_file_keeps_its_blocks(converted, folders, arch):
    """The Q8_0 linear weights stay the file's blocks, which are hyserve's int8 of the folder's weights."""
    rt = ModelRuntime.load(converted(arch, "q8_0"), device="cpu", quantization="int8")  # weight-only
    int8 = ModelRuntime.load(folders(arch), device="cpu", quantization="int8")
    kept, ours = _blocks(rt.model), _blocks(int8.model)
    assert len(kept) >= 8 and "model.layers.2.self_attn.q_proj" in kept
    for name, (qs, d) in kept.items():
        assert torch.equal(qs, ours[name][0]) and torch.equal(d, ours[name][1]), name
    experts = _experts(rt.model)  # the stacked experts too, in a QuantExperts
    assert len(experts) == (0 if arch == "bamba" else 2 if arch == "jamba" else 3)
    _same_blocks(experts, _experts(int8.model))
    want, got = _logits(int8), _logits(rt)
    assert (got - want).abs().max() < 0.05 * want.abs().max()


def test_a_bamba_file_is_told_from_a_granite_one(converted):
    """Both are `granitehybrid`: RoPE without Granite's multipliers is a Bamba; rotary over other than half or all
    of the head (what the converter writes) is refused."""
    from gguf import GGUFReader

    meta = file_metadata([GGUFReader(converted("bamba"))])
    assert granite_hybrid.config(meta)["model_type"] == "bamba"
    granite = meta | {"granitehybrid.attention.scale": 0.1}
    with pytest.raises(GGUFError, match="rotary embedding over 8 of the 16 head dimensions in a Granite 4.0-H"):
        granite_hybrid.config(granite)
    assert granite_hybrid.config(granite | {"granitehybrid.rope.dimension_count": 16})["model_type"] == (
        "granitemoehybrid"
    )
    with pytest.raises(GGUFError, match="rotary embedding over 4 of the 16 head dimensions"):
        granite_hybrid.config(meta | {"granitehybrid.rope.dimension_count": 4})


def test_jamba_layer_patterns_are_read_back():
    meta = {
        "general.architecture": "jamba",
        "jamba.block_count": 8,
        "jamba.attention.head_count_kv": [0, 0, 0, 2, 0, 0, 0, 2],
        "jamba.embedding_length": 64,
        "jamba.attention.head_count": 4,
        "jamba.ssm.inner_size": 128,
        "jamba.expert_count": 4,
        "tensor_shapes": {f"blk.{i}.ffn_gate_exps.weight": (4, 8, 8) for i in (1, 3, 5, 7)}
        | {f"blk.{i}.attn_q.weight": (64, 64) for i in (3, 7)},
    }
    for key in ("feed_forward_length", "context_length", "attention.layer_norm_rms_epsilon", "ssm.state_size"):
        meta[f"jamba.{key}"] = 16
    meta |= {"jamba.ssm.conv_kernel": 4, "jamba.ssm.time_step_rank": 4, "tokenizer.ggml.tokens": ["a"]}
    cfg = jamba.config(meta)
    assert (cfg["attn_layer_offset"], cfg["attn_layer_period"]) == (3, 4)
    assert (cfg["expert_layer_offset"], cfg["expert_layer_period"]) == (1, 2)
    meta["jamba.attention.head_count_kv"] = [0, 0, 0, 2, 0, 2, 0, 0]
    meta["tensor_shapes"] = {k.replace("blk.7.attn_q", "blk.5.attn_q"): v for k, v in meta["tensor_shapes"].items()}
    with pytest.raises(GGUFError, match=r"the attention layers \[3, 5\] are not every n-th layer"):
        jamba.config(meta)


def test_float32_buffers_stay_float32_as_from_the_folder(converted, folders):
    """LFM2-MoE's router bias is a float32 buffer in a bfloat16 model, from its folder and from its file alike."""
    rt = ModelRuntime.load(converted("lfm2_moe"), dtype="bfloat16", device="cpu")
    folder = ModelRuntime.load(folders("lfm2_moe"), dtype="bfloat16", device="cpu")
    want = {name: b.dtype for name, b in folder.model.named_buffers() if name.endswith("expert_bias")}
    assert set(want.values()) == {torch.float32}
    assert {name: b.dtype for name, b in rt.model.named_buffers() if name.endswith("expert_bias")} == want
    assert rt.model.model.embed_tokens.weight.dtype == torch.bfloat16
    torch.testing.assert_close(_logits(rt), _logits(folder))

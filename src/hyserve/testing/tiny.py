"""Build small random-init model directories, so tests, the demo and benchmarks never download weights.

Each directory is a normal Hugging Face model folder (config.json, model.safetensors, tokenizer.json,
tokenizer_config.json with a ChatML chat template) that `hyserve serve` loads like a real checkpoint.
With `chat_template=PATH` the directory carries that template instead (a real model's), and its tokenizer
the template's control tokens: `<|...|>` (and Nemotron's `<SPECIAL_N>`) strings as special tokens, and the tags Qwen
tokenizers keep as plain added tokens (`<think>`, `<tool_call>`, ...) as non-special ones, as in the real tokenizers.
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from .. import model_thread
from ..logs import human_count

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

log = logging.getLogger("hyserve.tiny")

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Tags real Qwen tokenizers hold as added tokens that are *not* special (they stay in decoded text).
PLAIN_TAGS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
EOS_BY_TEMPLATE = ["<|im_end|>", "<|eot_id|>", "<|end_of_text|>"]  # a template's end-of-turn token, first found
LLAMA_BOS = "<|begin_of_text|>"

CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}{{- part['text'] }}{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_TRAINING_TEXT = """
The quick brown fox jumps over the lazy dog. A recurrent model keeps a fixed size state that
summarises everything it has read so far, while an attention layer keeps one key and one value for
every token. You are a helpful assistant. Please answer the question briefly and clearly.
What is the capital of France? The capital of France is Paris. How many legs does a spider have?
Write a function that returns the sum of two numbers. def add(a, b): return a + b
Here is the file you asked about, with the change applied. Thank you for the explanation!
Tell me a story about a robot who learns to paint. Once upon a time there was a small robot.
The weather today is sunny with a light breeze from the west, and tomorrow it may rain.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000. Punctuation: , . ; : ! ? ( ) [ ] { } " ' - _ / \\ = + * #
Unicode: café naïve über 東京 😀 — “quotes” and ‘apostrophes’.
"""

# Family -> config overrides. Sizes follow the guide: hidden 64-128, 2-4 layers for tests.
_ATTENTION = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
_GATED_DELTANET = dict(
    **_ATTENTION,
    intermediate_size=128,
    num_hidden_layers=4,
    head_dim=16,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    layer_types=["linear_attention"] * 3 + ["full_attention"],
)
_QWEN_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
_MAMBA2_IBM = dict(mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_n_groups=1, mamba_chunk_size=32)
_MAMBA2_NEMOTRON = dict(mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16, n_groups=1, chunk_size=32, head_dim=16)
_LFM2 = dict(
    **_ATTENTION, num_hidden_layers=4, intermediate_size=128, layer_types=["conv", "conv", "full_attention", "conv"]
)
_TINY = {
    "qwen3_5": dict(model_type="qwen3_5_text", **_GATED_DELTANET),
    "qwen3_next": dict(model_type="qwen3_next", **_GATED_DELTANET, **_QWEN_MOE, decoder_sparse_step=1),
    "mamba2": dict(
        model_type="mamba2",
        hidden_size=64,
        num_hidden_layers=2,
        num_heads=8,
        head_dim=16,
        state_size=16,
        expand=2,
        n_groups=1,
        conv_kernel=4,
        chunk_size=32,
    ),
    "qwen3": dict(model_type="qwen3", **_ATTENTION, intermediate_size=128, num_hidden_layers=2, head_dim=16),
    # The hybrid families of issue 21, each from its transformers config class.
    "qwen3_5_moe": dict(model_type="qwen3_5_moe_text", **_GATED_DELTANET, **_QWEN_MOE),
    "nemotron_h": dict(
        model_type="nemotron_h",
        **_ATTENTION,
        **_MAMBA2_NEMOTRON,
        layers_block_type=["linear_attention", "full_attention", "moe", "linear_attention", "mlp"],
        intermediate_size=128,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=32,
    ),
    "granitemoehybrid": dict(
        model_type="granitemoehybrid",
        **_ATTENTION,
        **_MAMBA2_IBM,
        num_hidden_layers=4,
        layer_types=["mamba", "mamba", "attention", "mamba"],
        intermediate_size=32,
        shared_intermediate_size=64,
        num_local_experts=4,
        num_experts_per_tok=2,
    ),
    "bamba": dict(
        model_type="bamba",
        **_ATTENTION,
        **_MAMBA2_IBM,
        num_hidden_layers=4,
        attn_layer_indices=[2],
        intermediate_size=128,
    ),
    "falcon_h1": dict(
        model_type="falcon_h1",
        **_ATTENTION,
        **_MAMBA2_IBM,
        num_hidden_layers=2,
        intermediate_size=128,
        mamba_d_ssm=128,
    ),
    "lfm2": dict(model_type="lfm2", **_LFM2, block_auto_adjust_ff_dim=False),
    "lfm2_moe": dict(
        model_type="lfm2_moe",
        **_LFM2,
        num_dense_layers=1,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
    ),
    "jamba": dict(
        model_type="jamba",
        **_ATTENTION,
        num_hidden_layers=4,
        intermediate_size=128,
        attn_layer_period=4,
        attn_layer_offset=2,
        expert_layer_period=2,
        expert_layer_offset=1,
        num_experts=4,
        num_experts_per_tok=2,
        mamba_d_state=16,
    ),
    "zamba2": dict(
        model_type="zamba2",
        hidden_size=64,
        num_attention_heads=4,
        max_position_embeddings=4096,
        layers_block_type=["mamba", "hybrid", "mamba", "hybrid"],
        num_hidden_layers=4,
        intermediate_size=128,
        mamba_d_state=16,
        n_mamba_heads=8,
        mamba_ngroups=1,
        chunk_size=32,
    ),
}

# A bench-sized variant (~tens of millions of parameters) for benchmarks/, never for unit tests: overrides of the
# tiny sizes above.
_BENCH_ATTENTION = dict(hidden_size=512, num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=32768)
_BENCH_GATED_DELTANET = dict(
    **_BENCH_ATTENTION,
    num_hidden_layers=8,
    head_dim=64,
    linear_key_head_dim=64,
    linear_value_head_dim=64,
    linear_num_key_heads=4,
    linear_num_value_heads=8,
    layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2,
)
_BENCH_MAMBA2_IBM = dict(mamba_n_heads=16, mamba_d_head=64, mamba_d_state=64, mamba_chunk_size=128)
_BENCH_LFM2 = dict(
    **_BENCH_ATTENTION,
    num_hidden_layers=8,
    intermediate_size=1536,
    layer_types=["conv", "conv", "full_attention", "conv"] * 2,
)
_BENCH = {
    "qwen3_5": dict(**_BENCH_GATED_DELTANET, intermediate_size=1536),
    "mamba2": dict(hidden_size=512, num_hidden_layers=8, num_heads=16, head_dim=64, state_size=64, chunk_size=128),
    "qwen3": dict(**_BENCH_ATTENTION, intermediate_size=1536, num_hidden_layers=8, head_dim=64),
    "qwen3_5_moe": dict(
        **_BENCH_GATED_DELTANET,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=512,
    ),
    "nemotron_h": dict(
        **_BENCH_ATTENTION,
        layers_block_type=["linear_attention", "mlp", "linear_attention", "full_attention", "moe"] * 2,
        mamba_num_heads=16,
        mamba_head_dim=64,
        ssm_state_size=64,
        chunk_size=128,
        head_dim=64,
        intermediate_size=1536,
        n_routed_experts=8,
        moe_intermediate_size=512,
        moe_shared_expert_intermediate_size=512,
    ),
    "granitemoehybrid": dict(
        **_BENCH_ATTENTION,
        **_BENCH_MAMBA2_IBM,
        num_hidden_layers=8,
        layer_types=(["mamba"] * 3 + ["attention"]) * 2,
        num_local_experts=8,
        intermediate_size=512,
        shared_intermediate_size=1024,
    ),
    "bamba": dict(
        **_BENCH_ATTENTION, **_BENCH_MAMBA2_IBM, num_hidden_layers=8, attn_layer_indices=[3, 7], intermediate_size=1536
    ),
    "falcon_h1": dict(
        **_BENCH_ATTENTION,
        **_BENCH_MAMBA2_IBM,
        num_hidden_layers=8,
        head_dim=64,
        intermediate_size=1536,
        mamba_d_ssm=1024,
    ),
    "lfm2": dict(_BENCH_LFM2),
    "lfm2_moe": dict(**_BENCH_LFM2, num_dense_layers=2, num_experts=8, moe_intermediate_size=512),
    "jamba": dict(**_BENCH_ATTENTION, num_hidden_layers=8, intermediate_size=1024, num_experts=4),
    "zamba2": dict(
        hidden_size=512,
        num_attention_heads=8,
        max_position_embeddings=32768,
        num_hidden_layers=8,
        layers_block_type=(["mamba"] * 3 + ["hybrid"]) * 2,
        intermediate_size=1536,
        mamba_d_state=64,
        n_mamba_heads=16,
        chunk_size=128,
    ),
}

# Real dimensions, for measuring speed at the sizes people serve (benchmarks only). The tokenizer stays the small
# trained one, so ids above its size are never produced by it.
# - real-0.8b: a Qwen3.5 of 0.75B parameters (tied embeddings, 24 layers, 18 Gated DeltaNet + 6 full attention, the
#   real vocabulary size; ~3 GB in float32).
# - real-4b: Qwen3.5-4B's text model at its published dimensions (hidden 2560, MLP 9216, 32 layers: 24 Gated
#   DeltaNet + 8 full attention, 16 q / 4 kv heads x 256, linear attention 16 k / 32 v heads x 128, tied
#   embeddings, the real vocabulary): 4.2B parameters, saved in bfloat16 like the real checkpoint (~8.4 GB). The
#   model is built in bfloat16 (`from_config(dtype=...)` creates every parameter in it) and safetensors writes
#   from the tensors' memory, so no float32 copy of the whole model ever exists (~9 GB peak instead of ~25 GB).
# - real-moe: Qwen3.5-35B-A3B's layer at its real dimensions (hidden 2048, 16 q / 2 kv heads x 256, linear attention
#   16 k / 32 v heads x 128, experts of 512 with 8 routed + 1 shared per token, the real vocabulary), with 64 experts
#   instead of 256 and 4 layers (3 Gated DeltaNet + 1 full attention) instead of 40, and tied embeddings (the head's
#   work is the same; its copy is not): 1.46B parameters, saved in bfloat16 like the real checkpoint (~2.9 GB).
#   Per token it does the real layer's work; 256 experts would be 0.8B parameters a layer.
_REAL_QWEN35 = dict(  # what every real size shares: Qwen3.5's head widths, linear-attention key heads, vocabulary
    head_dim=256,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_num_key_heads=16,
    max_position_embeddings=32768,
    vocab_size=248320,
    tie_word_embeddings=True,
)
_REAL = {
    "real-0.8b": {
        "qwen3_5": dict(
            **_REAL_QWEN35,
            hidden_size=1024,
            intermediate_size=3584,
            num_hidden_layers=24,
            num_attention_heads=8,
            num_key_value_heads=2,
            linear_num_value_heads=16,
            layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 6,
        ),
    },
    "real-4b": {
        "qwen3_5": dict(
            **_REAL_QWEN35,
            hidden_size=2560,
            intermediate_size=9216,
            num_hidden_layers=32,
            num_attention_heads=16,
            num_key_value_heads=4,
            linear_num_value_heads=32,
            layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 8,
            save_dtype="bfloat16",
        ),
    },
    "real-moe": {
        "qwen3_5_moe": dict(
            **_REAL_QWEN35,
            hidden_size=2048,
            num_hidden_layers=4,
            num_attention_heads=16,
            num_key_value_heads=2,
            linear_num_value_heads=32,
            layer_types=["linear_attention"] * 3 + ["full_attention"],
            num_experts=64,
            num_experts_per_tok=8,
            moe_intermediate_size=512,
            shared_expert_intermediate_size=512,
            save_dtype="bfloat16",
        ),
    },
}
SIZES = ("tiny", "bench", *_REAL)

ARCHS = tuple(_TINY)


def train_tokenizer(vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """Byte-level BPE trained on a built-in text: every byte string is encodable, like real Qwen tokenizers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_TRAINING_TEXT] * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=4096,
    )
    fast.chat_template = CHATML_TEMPLATE
    return fast


def use_template(tokenizer: PreTrainedTokenizerFast, template: str) -> PreTrainedTokenizerFast:
    """Give `tokenizer` a real chat template and the control tokens it writes (see the module docstring)."""
    from tokenizers import AddedToken

    # (Nemotron's templates write their control tokens as `<SPECIAL_N>`)
    specials = sorted(set(re.findall(r"<\|[A-Za-z0-9_]+\|>|<SPECIAL_\d+>", template)) - set(SPECIAL_TOKENS))
    if "bos_token" in template and LLAMA_BOS not in specials:
        specials.append(LLAMA_BOS)
    tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in specials], special_tokens=True)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in PLAIN_TAGS if t in template])
    if "bos_token" in template:
        tokenizer.bos_token = LLAMA_BOS
    tokenizer.eos_token = next((t for t in EOS_BY_TEMPLATE if t in template), tokenizer.eos_token)
    tokenizer.chat_template = template
    return tokenizer


class FolderNotEmpty(FileExistsError):
    """`make_tiny_model` was pointed at a folder that already holds files (perhaps a real model's)."""


def make_tiny_model(
    out_dir: str | Path,
    arch: str | None = None,
    size: str = "tiny",
    seed: int = 0,
    force: bool = False,
    chat_template: str | Path | None = None,
) -> Path:
    """Write a random-init model of `arch` plus tokenizer into `out_dir` and return the path.
    `arch`: qwen3_5 by default, or the one family a real size is made for (real-moe: qwen3_5_moe).
    `chat_template`: the path of a real template to use instead of ChatML.

    A folder that already holds files is refused (FolderNotEmpty) unless `force`; even then only the files
    this writes are replaced, nothing else in the folder is touched. Everything is written to a temporary
    folder beside it first (transformers' save_pretrained deletes weight shards it did not write in the
    folder it saves to) and moved in file by file."""
    if arch is None:
        arch = default_arch(size)
    if arch not in _TINY:
        raise ValueError(f"unknown arch {arch!r}; choose one of {', '.join(ARCHS)}")
    if size not in SIZES:
        raise ValueError(f"size must be one of {', '.join(SIZES)}")
    if size == "bench" and arch not in _BENCH:
        raise ValueError(f"no bench size for {arch!r}; choose one of {', '.join(_BENCH)}")
    if size in _REAL and arch not in _REAL[size]:
        raise ValueError(f"no {size} size for {arch!r}; choose one of {', '.join(_REAL[size])}")
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise FolderNotEmpty(f"{out} exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise FolderNotEmpty(
            f"{out} is not empty: refusing to write a random-init model over what is there "
            "(pass --force to write into it anyway; files it does not write are kept)"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.tmp-") as tmp:
        _write(Path(tmp), arch, size, seed, chat_template)
        out.mkdir(exist_ok=True)
        written = sorted(f.name for f in Path(tmp).iterdir())
        for name in written:
            os.replace(Path(tmp) / name, out / name)  # same file system: each file appears whole
    log.info("wrote %s into %s", ", ".join(written), out)
    return out


def default_arch(size: str) -> str:
    """qwen3_5, or the family of a real size made for one other family only."""
    archs = list(_REAL.get(size, ()))
    return archs[0] if len(archs) == 1 else "qwen3_5"


def model_config(arch: str, size: str, tokenizer: PreTrainedTokenizerFast):
    """(transformers config, dtype the weights are saved in) of `arch` at `size`, for `tokenizer`."""
    import torch
    from transformers import AutoConfig

    overrides = dict(_TINY[arch])
    if size != "tiny":
        overrides.update(_BENCH[arch] if size == "bench" else _REAL[size][arch])
        tokenizer.model_max_length = overrides.get("max_position_embeddings", 32768)
    model_type = overrides.pop("model_type")
    vocab_size = overrides.pop("vocab_size", len(tokenizer))
    tied = overrides.pop("tie_word_embeddings", False)
    save_dtype = getattr(torch, overrides.pop("save_dtype", "float32"))
    pad = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    config = AutoConfig.for_model(
        model_type,
        vocab_size=vocab_size,
        eos_token_id=tokenizer.convert_tokens_to_ids(tokenizer.eos_token),
        pad_token_id=pad,
        bos_token_id=pad,
        tie_word_embeddings=tied,
        **overrides,
    )
    return config, save_dtype


def silence_unknown_ids(model, known: int) -> None:
    """Zero the embedding and head rows of ids at or above `known` (the tokenizer's size).

    A real-size model keeps the real vocabulary (248k rows: the head's work per token is the real one) over
    a tokenizer of a few hundred tokens. With random rows there, greedy replies pick ids with no text, and a
    chat's history would carry empty replies. A zero head row gives logit 0, below the best of the random
    logits of the known ids, so replies are text; the shapes, and so the work per token, stay the same."""
    import torch

    with torch.no_grad():
        for emb in {id(m): m for m in (model.get_input_embeddings(), model.get_output_embeddings())}.values():
            if emb is not None and emb.weight.shape[0] > known:
                emb.weight[known:].zero_()


def _write(out: Path, arch: str, size: str, seed: int, chat_template: str | Path | None = None) -> None:
    import torch  # here, not at import: `hyserve --help` needs only ARCHS from this module
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    log.info("training the tokenizer")
    tokenizer = train_tokenizer()
    if chat_template is not None:
        use_template(tokenizer, Path(chat_template).read_text())
    config, save_dtype = model_config(arch, size, tokenizer)
    hf_logging.disable_progress_bar()

    def build() -> None:  # random init runs torch ops: on the model thread, like all model work
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=save_dtype)
        silence_unknown_ids(model, len(tokenizer))
        log.info(
            "random-init %s: %s parameters; saving",
            config.model_type,
            human_count(sum(p.numel() for p in model.parameters())),
        )
        model.generation_config.eos_token_id = config.eos_token_id
        model.generation_config.pad_token_id = config.pad_token_id
        model.save_pretrained(out)

    model_thread.run(build)
    tokenizer.save_pretrained(out)

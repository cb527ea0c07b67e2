"""Build small random-init model directories, so tests, the demo and benchmarks never download weights.

Each directory is a normal Hugging Face model folder (config.json, model.safetensors, tokenizer.json,
tokenizer_config.json with a ChatML chat template) that `hyserve serve` loads like a real checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast
from transformers.utils import logging as hf_logging

from . import model_thread

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

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
_GATED_DELTANET = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
    linear_num_key_heads=2, linear_num_value_heads=4,
    layer_types=["linear_attention"] * 3 + ["full_attention"],
    max_position_embeddings=4096,
)
_ATTENTION = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
_MAMBA2_IBM = dict(mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_n_groups=1, mamba_chunk_size=32)
_MAMBA2_NEMOTRON = dict(mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16, n_groups=1, chunk_size=32, head_dim=16)
_TINY = {
    "qwen3_5": dict(model_type="qwen3_5_text", **_GATED_DELTANET),
    "qwen3_next": dict(
        model_type="qwen3_next", **_GATED_DELTANET,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, decoder_sparse_step=1,
    ),
    "mamba2": dict(
        model_type="mamba2",
        hidden_size=64, num_hidden_layers=2, num_heads=8, head_dim=16, state_size=16,
        expand=2, n_groups=1, conv_kernel=4, chunk_size=32,
    ),
    "qwen3": dict(
        model_type="qwen3",
        hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=4096,
    ),
    # The hybrid families of issue 21, each from its transformers config class.
    "qwen3_5_moe": dict(
        model_type="qwen3_5_moe_text", **_GATED_DELTANET,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
    ),
    "nemotron_h": dict(
        model_type="nemotron_h", **_ATTENTION, **_MAMBA2_NEMOTRON,
        layers_block_type=["linear_attention", "full_attention", "moe", "linear_attention", "mlp"],
        intermediate_size=128, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=32,
    ),
    "granitemoehybrid": dict(
        model_type="granitemoehybrid", **_ATTENTION, **_MAMBA2_IBM, num_hidden_layers=4,
        layer_types=["mamba", "mamba", "attention", "mamba"],
        intermediate_size=32, shared_intermediate_size=64, num_local_experts=4, num_experts_per_tok=2,
    ),
    "bamba": dict(
        model_type="bamba", **_ATTENTION, **_MAMBA2_IBM, num_hidden_layers=4, attn_layer_indices=[2],
        intermediate_size=128,
    ),
    "falcon_h1": dict(
        model_type="falcon_h1", **_ATTENTION, **_MAMBA2_IBM, num_hidden_layers=2, intermediate_size=128,
        mamba_d_ssm=128,
    ),
    "lfm2": dict(
        model_type="lfm2", **_ATTENTION, num_hidden_layers=4, intermediate_size=128,
        layer_types=["conv", "conv", "full_attention", "conv"], block_auto_adjust_ff_dim=False,
    ),
    "lfm2_moe": dict(
        model_type="lfm2_moe", **_ATTENTION, num_hidden_layers=4, intermediate_size=128,
        layer_types=["conv", "conv", "full_attention", "conv"], num_dense_layers=1,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
    ),
    "jamba": dict(
        model_type="jamba", **_ATTENTION, num_hidden_layers=4, intermediate_size=128,
        attn_layer_period=4, attn_layer_offset=2, expert_layer_period=2, expert_layer_offset=1,
        num_experts=4, num_experts_per_tok=2, mamba_d_state=16,
    ),
    "zamba2": dict(
        model_type="zamba2", hidden_size=64, num_attention_heads=4, max_position_embeddings=4096,
        layers_block_type=["mamba", "hybrid", "mamba", "hybrid"], num_hidden_layers=4, intermediate_size=128,
        mamba_d_state=16, n_mamba_heads=8, mamba_ngroups=1, chunk_size=32,
    ),
}

# A bench-sized variant (~tens of millions of parameters) for benchmarks/, never for unit tests.
_BENCH_ATTENTION = dict(hidden_size=512, num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=32768)
_BENCH_MAMBA2_IBM = dict(mamba_n_heads=16, mamba_d_head=64, mamba_d_state=64, mamba_chunk_size=128)
_BENCH = {
    "qwen3_5": dict(
        hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
        num_key_value_heads=2, head_dim=64, linear_key_head_dim=64, linear_value_head_dim=64,
        linear_num_key_heads=4, linear_num_value_heads=8,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2,
        max_position_embeddings=32768,
    ),
    "mamba2": dict(hidden_size=512, num_hidden_layers=8, num_heads=16, head_dim=64, state_size=64, chunk_size=128),
    "qwen3": dict(
        hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
        num_key_value_heads=2, head_dim=64, max_position_embeddings=32768,
    ),
    "qwen3_5_moe": dict(
        hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
        linear_key_head_dim=64, linear_value_head_dim=64, linear_num_key_heads=4, linear_num_value_heads=8,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2, max_position_embeddings=32768,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=512, shared_expert_intermediate_size=512,
    ),
    "nemotron_h": dict(
        **_BENCH_ATTENTION, layers_block_type=["linear_attention", "mlp", "linear_attention", "full_attention", "moe"] * 2,
        mamba_num_heads=16, mamba_head_dim=64, ssm_state_size=64, chunk_size=128, head_dim=64, intermediate_size=1536,
        n_routed_experts=8, moe_intermediate_size=512, moe_shared_expert_intermediate_size=512,
    ),
    "granitemoehybrid": dict(
        **_BENCH_ATTENTION, **_BENCH_MAMBA2_IBM, num_hidden_layers=8, layer_types=(["mamba"] * 3 + ["attention"]) * 2,
        num_local_experts=8, intermediate_size=512, shared_intermediate_size=1024,
    ),
    "bamba": dict(**_BENCH_ATTENTION, **_BENCH_MAMBA2_IBM, num_hidden_layers=8, attn_layer_indices=[3, 7],
                  intermediate_size=1536),
    "falcon_h1": dict(**_BENCH_ATTENTION, **_BENCH_MAMBA2_IBM, num_hidden_layers=8, head_dim=64, intermediate_size=1536,
                      mamba_d_ssm=1024),
    "lfm2": dict(**_BENCH_ATTENTION, num_hidden_layers=8, intermediate_size=1536,
                 layer_types=["conv", "conv", "full_attention", "conv"] * 2),
    "lfm2_moe": dict(**_BENCH_ATTENTION, num_hidden_layers=8, intermediate_size=1536,
                     layer_types=["conv", "conv", "full_attention", "conv"] * 2, num_dense_layers=2,
                     num_experts=8, moe_intermediate_size=512),
    "jamba": dict(**_BENCH_ATTENTION, num_hidden_layers=8, intermediate_size=1024, num_experts=4),
    "zamba2": dict(hidden_size=512, num_attention_heads=8, max_position_embeddings=32768, num_hidden_layers=8,
                   layers_block_type=(["mamba"] * 3 + ["hybrid"]) * 2, intermediate_size=1536, mamba_d_state=64,
                   n_mamba_heads=16, chunk_size=128),
}

ARCHS = tuple(_TINY)


def train_tokenizer(vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """Byte-level BPE trained on a built-in text: every byte string is encodable, like real Qwen tokenizers."""
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


def make_tiny_model(out_dir: str | Path, arch: str = "qwen3_5", size: str = "tiny", seed: int = 0) -> Path:
    """Write a random-init model of `arch` plus tokenizer into `out_dir` and return the path."""
    if arch not in _TINY:
        raise ValueError(f"unknown arch {arch!r}; choose one of {', '.join(ARCHS)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer()
    overrides = dict(_TINY[arch])
    if size == "bench":
        if arch not in _BENCH:
            raise ValueError(f"no bench size for {arch!r}; choose one of {', '.join(_BENCH)}")
        overrides.update(_BENCH[arch])
        tokenizer.model_max_length = overrides.get("max_position_embeddings", 32768)
    elif size != "tiny":
        raise ValueError("size must be 'tiny' or 'bench'")
    model_type = overrides.pop("model_type")
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    pad = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    config = AutoConfig.for_model(
        model_type,
        vocab_size=len(tokenizer),
        eos_token_id=eos,
        pad_token_id=pad,
        bos_token_id=pad,
        tie_word_embeddings=False,
        **overrides,
    )
    hf_logging.disable_progress_bar()

    def build() -> None:  # random init runs torch ops: on the model thread, like all model work
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.generation_config.eos_token_id = eos
        model.generation_config.pad_token_id = pad
        model.save_pretrained(out)

    model_thread.run(build)
    tokenizer.save_pretrained(out)
    return out

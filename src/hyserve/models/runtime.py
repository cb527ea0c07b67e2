"""Load a Hugging Face model directory (or a GGUF file, `hyserve.gguf`) and hold what every request needs from it.

Weights come only from the local directory (never a hub download). The family adapter is chosen from
`config.model_type`, so an unknown family fails at start-up with the list of supported ones.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import gguf, kernels, model_thread, quant
from ..allocator import hand_back_freed, huge_page_bytes, keep_freed_memory
from ..families import FamilyAdapter, UnsupportedModelError, adapter_for  # noqa: F401 (the CLI catches it here)
from ..logs import human_bytes, human_count
from ..model_files import WEIGHT_GLOBS
from ..prompt import next_turn
from ..prompt.bound import check_length, max_chars_per_token
from ..prompt.escape import MARK, ContentEscaper
from ..prompt.tokens import PrefixEncoder
from . import experts
from .preflight import read_model_type

log = logging.getLogger("hyserve.runtime")

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def context_length(model_config, tokenizer) -> int:
    """The context a model serves, from its config alone (so a process without the weights, the Ray ingress,
    refuses the same prompts by length as a replica)."""
    max_len = getattr(model_config.get_text_config(), "max_position_embeddings", None) or tokenizer.model_max_length
    if not isinstance(max_len, int) or max_len > 10**7:
        max_len = 32768
    return int(max_len)


@dataclass
class ModelRuntime:
    """The loaded model, its tokenizer and adapter; `lock` serialises every forward pass on the model."""

    model: object
    tokenizer: object
    adapter: FamilyAdapter
    model_dir: Path
    eos_token_ids: frozenset[int]
    max_model_len: int
    lock: threading.Lock
    prompt_encoder: PrefixEncoder | None = None  # tokenizes a prompt from the ids of an earlier one it extends
    special_tokens_in_content: bool = False  # True: special-token strings in message content are control tokens
    escaper: ContentEscaper | None = None  # keeps them text otherwise (`prompt_escape`)
    chars_per_token: int | None = None  # a prompt longer than this many characters per context token is refused
    quantization: quant.Quantized | None = None  # what `--quantization` did to the weights (None: not asked)
    gguf_tensors: object = None  # a GGUF file's: what the load kept quantized and converted (`gguf.loader.Loaded`)

    def __post_init__(self) -> None:
        if self.escaper is None:
            try:
                self.escaper = ContentEscaper(self.tokenizer)
            except ValueError as exc:
                log.warning("special-token strings in message content cannot be kept as text: %s", exc)
        if self.prompt_encoder is None:
            self.prompt_encoder = PrefixEncoder(self.tokenizer, escaper=self.escaper)
        if self.chars_per_token is None:
            self.chars_per_token = max_chars_per_token(self.tokenizer)

    @classmethod
    def load(
        cls, model_dir: str | Path, dtype: str = "float32", device: str = "auto", quantization: str | None = None
    ) -> ModelRuntime:
        """Load on the model thread, where all later model work runs (see `model_thread`). `quantization`:
        a scheme of `quant.SCHEMES` applied to the weights at load, or None."""
        keep_freed_memory()  # before the model thread's first allocation
        return model_thread.run(cls._load, model_dir, dtype, device, quantization)

    @classmethod
    def _load(cls, model_dir: str | Path, dtype: str, device: str, quantization: str | None = None) -> ModelRuntime:
        from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        model_dir = Path(model_dir)
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}")
        if quantization is not None and quantization not in quant.SCHEMES:
            raise ValueError(f"quantization must be one of {', '.join(quant.SCHEMES)}")
        device = resolve_device(device)
        if quantization is not None and device != "cpu":
            raise ValueError(f"--quantization {quantization} runs on CPU only (the device is {device})")
        start = time.perf_counter()
        is_gguf, from_file, made = gguf.is_gguf(model_dir), None, None
        if is_gguf:
            info = gguf.inspect(model_dir)
            log.info(
                "loading %s (GGUF %s, %s): tensors %s, as %s on %s",
                info.path,
                info.architecture,
                human_bytes(info.path.stat().st_size),
                info.describe(),
                dtype,
                device,
            )
            model, tokenizer, from_file = gguf.load(info.path, _DTYPES[dtype], device)
            log.info("GGUF tensors: %s", from_file.describe())
        else:
            model_type = read_model_type(model_dir)
            if why := quant.checkpoint.refusal(model_dir):
                raise ValueError(why)
            weights = [f for pattern in WEIGHT_GLOBS for f in model_dir.glob(pattern)]
            log.info(
                "loading %s (%s): %d weight file(s), %s, as %s on %s",
                model_dir,
                model_type,
                len(weights),
                human_bytes(sum(f.stat().st_size for f in weights)),
                dtype,
                device,
            )
            if quantization is not None:  # each weight quantized as it is loaded: never the whole float model
                model, made = quant.loading.load(model_dir, _DTYPES[dtype], quantization)
            else:
                model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=_DTYPES[dtype], local_files_only=True)
            model.to(device).eval()
        log.info(
            "weights loaded in %.1f s: %s, %s parameters",
            time.perf_counter() - start,
            type(model).__name__,
            human_count(sum(p.numel() for p in model.parameters())),
        )
        adapter = adapter_for(model)
        quantized = None
        if is_gguf and quantization is None:  # the file's blocks computed as llama.cpp computes them: the fast path
            quant.round_activations_of_kept(model)
        if is_gguf:
            log.info(
                "the file's quantized blocks: %s",
                f"weight-only products, activations as they are (--quantization {quantization})"
                if quantization in quant.WEIGHT_ONLY
                else "each product's input rounded to Q8_0 blocks (Q8_K for K-quants), as llama.cpp computes "
                "(--quantization int8 or int4: weight-only, transformers' numbers)",
            )
        if quantization in quant.WEIGHT_ONLY:
            quant.ggml_blocks.take_activations_as_they_are(model)
        if quantization is not None:
            t0 = time.perf_counter()
            quantized = quant.apply(model, quantization, made and made.held)
            del made  # the placeholders, now replaced
            log.info("weights quantized in %.1f s: %s", time.perf_counter() - t0, quantized.describe())
        t0 = time.perf_counter()
        if quant.runs_all_experts(model):  # under --quantization, or a GGUF file's experts kept as blocks
            log.info("experts: hyserve's loop over the quantized experts (quant.experts)")
        elif impl := experts.choose(model, adapter, model.config.get_text_config().vocab_size):
            log.info("experts: %s (checked against eager in %.1f s)", impl, time.perf_counter() - t0)
            t0 = time.perf_counter()
        kernels.install(model, adapter, model.config.get_text_config().vocab_size)
        held = (quant.QuantLinear, quant.QuantExperts, quant.GgmlLinear)
        if quantized is not None or any(isinstance(m, held) for m in model.modules()):
            _install_quantized_products(model, adapter, _DTYPES[dtype])  # ours, or a GGUF file's kept blocks
        on = [name for name, status in adapter.kernels.status.items() if status == "on"]
        log.info(
            "kernel check in %.1f s: %d of %d of hyserve's kernels on%s",
            time.perf_counter() - t0,
            len(on),
            len(adapter.kernels.status),
            ""
            if len(on) == len(adapter.kernels.status)
            else " (the others run transformers' own functions; `hyserve env MODEL_DIR` says why)",
        )
        if device == "cpu" and (freed := hand_back_freed()):
            log.info("the load's freed memory handed back to the OS: %s", human_bytes(freed))
        if device == "cpu" and (huge := huge_page_bytes()) is not None:
            log.info(
                "weights and buffers on transparent huge pages: %s%s",
                human_bytes(huge),
                ""
                if huge
                else " (none: torch was imported before hyserve, or the kernel's transparent_hugepage is 'never')",
            )
        if not is_gguf:
            tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        eos: set[int] = set()
        try:  # a GGUF file has none: its end-of-turn token is the tokenizer's and the config's
            if not is_gguf:
                eos.update(_as_list(GenerationConfig.from_pretrained(model_dir, local_files_only=True).eos_token_id))
        except OSError:
            pass
        eos.update(_as_list(model.config.get_text_config().eos_token_id))
        if tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        max_len = context_length(model.config, tokenizer)
        log.info(
            "tokenizer loaded: %d tokens, context %d tokens, chat template %s; ready in %.1f s",
            len(tokenizer),
            max_len,
            "present" if tokenizer.chat_template else "MISSING (only /v1/completions works)",
            time.perf_counter() - start,
        )
        return cls(
            model,
            tokenizer,
            adapter,
            model_dir,
            frozenset(eos),
            int(max_len),
            threading.Lock(),
            quantization=quantized,
            gguf_tensors=from_file,
        )

    # -- prompts ---------------------------------------------------------------------------
    def render_chat(
        self, messages: list[dict], add_generation_prompt: bool, salt: str = "", template_kwargs: dict | None = None
    ) -> list[int]:
        """Token ids of the model's own chat template; this is also how checkpoint boundaries are found.
        `salt`: the tenant's namespace (the prefix cache's), for the tokenizer's reuse of earlier texts.
        `template_kwargs`: the request's extra template arguments (`tools`, `chat_template_kwargs`)."""
        (ids,) = self.render_many([(messages, add_generation_prompt)], salt, template_kwargs)
        if isinstance(ids, Exception):
            raise ids
        return ids

    def render_many(
        self, items: Sequence[tuple[list[dict], bool]], salt: str = "", template_kwargs: dict | None = None
    ) -> list[list[int] | Exception]:
        """`render_chat` of several (messages, add_generation_prompt) at once, each text tokenized from the
        ids of the longest earlier text of the same tenant it extends (`prompt_tokens`). Every render escapes
        the messages and template arguments alike (`prompt_escape`), so boundaries stay token prefixes of the
        prompt. A template error, or `PromptTooLong` for a text too long to fit, is returned in its item's
        place, not raised."""
        escape = self.escaper is not None and not self.special_tokens_in_content
        kwargs = dict(template_kwargs or {})
        if escape:  # tools and chat_template_kwargs: the client's too
            kwargs = dict(self.escaper.escape_value(kwargs))
        escaped: dict[int, dict] = {}  # the renders of one request share their messages: escape each once
        texts: list[str | Exception] = []
        for messages, gen in items:
            try:
                if escape:
                    for m in messages:
                        if id(m) not in escaped:
                            escaped[id(m)] = self.escaper.escape([m])[0]
                    messages = [escaped[id(m)] for m in messages]
                text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen, **kwargs)
                self._check_length(self.escaper.restore(text) if escape else text)
                texts.append(text)
            except Exception as exc:
                texts.append(exc)
        good = [t for t in texts if isinstance(t, str)]
        encoded = iter(self.prompt_encoder.encode_many(good, salt, self.max_model_len) if good else [])
        return [next(encoded) if isinstance(t, str) else t for t in texts]  # fresh lists already

    def render_next_turn(self, messages: list[dict], salt: str = "", template_kwargs: dict | None = None) -> list[int]:
        """Ids of `messages` (ending with a reply) as the next turn's prompt will start (`next_turn`)."""
        return next_turn.history_ids(
            messages, lambda items: self.render_many(items, salt, template_kwargs), self.special_ids
        )

    @functools.cached_property
    def special_ids(self) -> frozenset[int]:
        return next_turn.special_ids(self.tokenizer)

    def encode(self, text: str, salt: str = "") -> list[int]:
        """Ids of a raw prompt (completions): special-token strings in it are control tokens, as in vLLM; the
        caller owns the format there. Raises PromptTooLong before tokenizing a text that cannot fit."""
        self._check_length(text)
        if MARK in text:  # not a rendered chat: its private-use characters are not content markers
            return list(self.tokenizer([text], add_special_tokens=False)["input_ids"][0])
        return self.prompt_encoder.encode(text, salt, self.max_model_len)

    def _check_length(self, text: str) -> None:
        check_length(len(text), self.chars_per_token, self.max_model_len)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    @property
    def kernels(self):
        """Which of hyserve's kernels passed the load-time check for this model (`kernels.KernelReport`)."""
        return self.adapter.kernels

    @property
    def has_recurrent_layers(self) -> bool:
        return self.adapter.has_recurrent_layers


def _install_quantized_products(model, adapter, dtype) -> None:
    """The quantized weights' C products (`native_int8`, `native_int4`, `native_a8` or `native_ggml` in the kernel
    report, so that the disk cache's fingerprint tells quantized states from others) and the decode layers in C over
    them (`native_decode_layer`), or why each is off: then its products dequantize first, its layers run call by
    call."""
    from ..quant import ggml_native, native

    if not kernels.enabled():
        names = native.kernel_names(model) | ({ggml_native.KERNEL} if quant.ggml_blocks.held_layers(model) else set())
        decided = {name: "disabled (HYSERVE_KERNELS=0)" for name in sorted(names)}
    else:
        decided = quant.install_products(model, dtype)
    for name, why in decided.items():
        adapter.kernels.set(name, not why, why)
        if why and not why.startswith("disabled") and name == kernels.decode_layer.FUSED:
            log.warning("the C decode layers are off, each operation runs alone (slower, same results): %s", why)
        elif why and not why.startswith("disabled"):
            log.warning(
                "the C product %s is off, its weights are dequantized for every product (slower, same results): %s",
                name,
                why,
            )


def _as_list(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]

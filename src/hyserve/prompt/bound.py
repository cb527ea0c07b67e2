"""Refuse a prompt that cannot fit the context from its length alone, before tokenizing it.

Tokenizing costs time and memory in proportion to the text, all of it spent just to refuse a prompt of
megabytes (docs/design.md, "Figures behind some constants"). For a byte-level BPE no token covers more
characters than the longest entry of its vocabulary has bytes, so a text of L characters has at least L / N
tokens, N = `max_chars_per_token`, found once per model at load. A unicode normalizer that composes (NFC,
NFKC) can fold up to 4 code points into one character, so N is multiplied by 4 then. Pipelines that can drop
characters (whitespace-removing pre-tokenizers, Strip/Replace normalizers, added tokens that strip
whitespace, an unknown token that can swallow any run) have no such bound: `max_chars_per_token` returns
None and nothing is refused early.
"""

from __future__ import annotations

import json

_COMPOSE = {"NFC": 4, "NFKC": 4, "NFD": 1, "NFKD": 1}  # most code points one normalized character comes from
_PRE = {"ByteLevel", "Split", "Digits", "Punctuation"}


class PromptTooLong(ValueError):
    """The prompt has more tokens than the context holds, known without tokenizing it."""


def max_chars_per_token(tokenizer) -> int | None:
    """Most characters of input text one token can stand for, or None when the pipeline has no bound."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    config = json.loads(backend.to_str())
    model = config.get("model") or {}
    if model.get("type") != "BPE":
        return None
    factor = 1
    for kind in _kinds(config.get("normalizer"), "normalizers"):
        if kind not in _COMPOSE:
            return None
        factor = max(factor, _COMPOSE[kind])
    pre = list(_walk(config.get("pre_tokenizer"), "pretokenizers"))
    if "ByteLevel" not in [p["type"] for p in pre]:
        return None
    from tokenizers.pre_tokenizers import ByteLevel

    if not set(ByteLevel.alphabet()) <= set(model.get("vocab", {})):  # else an unknown token may fuse a run
        return None
    if any(p["type"] not in _PRE or str(p.get("behavior", "")).lower() == "removed" for p in pre):
        return None
    added = config.get("added_tokens", [])
    if any(t.get("lstrip") or t.get("rstrip") for t in added):
        return None
    longest = max([len(t) for t in model.get("vocab", {})] + [len(t["content"]) for t in added], default=1)
    return factor * longest


def check_length(chars: int, chars_per_token: int | None, max_model_len: int) -> None:
    """Raise PromptTooLong when `chars` characters surely make at least `max_model_len` tokens."""
    if chars_per_token and chars > chars_per_token * (max_model_len - 1):
        raise PromptTooLong(
            f"This model's maximum context length is {max_model_len} tokens. However, your prompt is {chars} "
            f"characters long, which is at least {-(-chars // chars_per_token)} tokens for this model's tokenizer."
        )


def _walk(node: dict | None, key: str):
    if not node:
        return
    if node.get("type") == "Sequence":
        for child in node.get(key, []):
            yield from _walk(child, key)
    else:
        yield node


def _kinds(node: dict | None, key: str) -> list[str]:
    return [n["type"] for n in _walk(node, key)]

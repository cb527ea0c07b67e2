"""Prompt tokenization that reuses the ids of an earlier text the new one extends.

A chat turn's prompt is the previous turn's prompt (or history) plus new text, so tokenizing it from
scratch costs O(history) per turn, twice per warm turn
(the prompt and its history boundary), plus the post-decode re-render on the model thread.

A Hugging Face `tokenizers` pipeline first cuts the text at every added token (`<|im_start|>`, ...),
then normalizes, pre-tokenizes and runs the model on each piece by itself. So if an earlier text P
has an added token matched at character s, and a new text T starts with P, then

    ids(T) = ids(P)[:j] + ids(T[s:])        (j = the index of that added token in ids(P))

as long as the match at s does not depend on what follows P: it must start at least the longest added
token's length before the end of P. `PrefixEncoder` keeps the last texts it encoded with the positions
of their added tokens and uses the longest cached prefix of each new text.

The identity holds by construction only for some pipelines, so `PrefixEncoder` is on only when the
tokenizer's JSON shows one (`_unsupported` says why not): added tokens used as cut points are
special, not normalized, strip nothing; the pre-tokenizer is ByteLevel / Split / Digits / Punctuation /
Whitespace (no Metaspace, whose first piece differs); no truncation or padding is configured. It also
checks itself: at start-up against full encodes of chat-like texts, and then every `VERIFY_EVERY`-th
reuse, falling back to full encodes for good on any mismatch.

Entries are namespaced by the tenant's salt (the prefix cache's), so one tenant's texts never speed up, and
so never reveal, another's; a clear of the tenant's cache drops its texts (`forget`). A text of `keep_below`
ids or more (a prompt the context cannot hold: it is refused) is not kept. Texts with content markers
(`prompt_escape`) are spliced after each encode; the identity above holds for them too, the cut points being
the template's own special tokens. Encodes go through `encode_batch`, which releases the GIL (`encode` holds
it for the whole text).
"""

from __future__ import annotations

import json
import logging
import sys
import threading
from array import array
from collections import OrderedDict
from collections.abc import Sequence

from ..cache.namespace import tenant_of
from .escape import MARK, ContentEscaper

log = logging.getLogger("hyserve.prompt_tokens")

VERIFY_EVERY = 64  # one reuse in this many is also encoded in full and compared
MAX_BYTES = 256 << 20  # what the kept texts and ids may take at most, whatever the context
_PRE_TOKENIZERS = {"ByteLevel", "Split", "Digits", "Punctuation", "Whitespace", "WhitespaceSplit"}
_NORMALIZERS = {"NFC", "NFD", "NFKC", "NFKD"}


class PrefixEncoder:
    """`encode_many(texts)` equals the transformers tokenizer's own call (`add_special_tokens=False`) text by
    text (with `escaper`: for texts with markers, that call on each marked piece with special tokens as
    text). Cached ids are kept as int32 arrays (a 32k-token prompt is 128 KiB). At most `capacity` texts and
    `max_bytes` of texts and ids are kept, least recently used out first: a long context times many texts
    must not grow a process without bound."""

    def __init__(
        self, tokenizer, capacity: int = 64, escaper: ContentEscaper | None = None, max_bytes: int = MAX_BYTES
    ):
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self._tokenizer = tokenizer
        self._escaper = escaper
        self.capacity = capacity
        self.max_bytes = max_bytes
        self.bytes = 0  # what the entries take (`_size`)
        self._entries: OrderedDict[tuple[str, str], tuple[array, list[tuple[int, int]]]] = OrderedDict()
        self._lock = threading.Lock()
        self._reuses = 0
        self.reused_tokens = 0  # ids taken from a cached prefix instead of being tokenized again
        self.hits = 0  # texts answered whole from an entry
        config = json.loads(self._backend.to_str()) if self._backend is not None else None
        self.reason = _unsupported(tokenizer, config)
        if self.reason is None:
            cut_tokens = [t for t in config["added_tokens"] if _cut_point(t)]
            self._cuts = {t["id"] for t in cut_tokens}
            self._margin = max(len(t["content"]) for t in config["added_tokens"])
            self.reason = self._self_check([t["content"] for t in cut_tokens][:3])
        if self.reason is not None:
            log.info("prompt prefix reuse off, prompts are tokenized in full: %s", self.reason)

    @property
    def enabled(self) -> bool:
        return self.reason is None

    def encode(self, text: str, salt: str = "", keep_below: int | None = None) -> list[int]:
        return self.encode_many([text], salt, keep_below)[0]

    def encode_many(self, texts: Sequence[str], salt: str = "", keep_below: int | None = None) -> list[list[int]]:
        """Ids of each text, reusing only entries of the same `salt`. Shortest first, so a longer text of the
        batch (the prompt) can extend a shorter one (its history boundary)."""
        if not self.enabled:
            return [self._reference(t) for t in texts]
        out: dict[int, list[int]] = {}
        for i in sorted(range(len(texts)), key=lambda k: len(texts[k])):
            out[i] = self._encode(texts[i], salt, keep_below)
        return [out[i] for i in range(len(texts))]

    # -- internals -------------------------------------------------------------------------------
    def _reference(self, text: str) -> list[int]:
        """What the text tokenizes to without reuse: the transformers tokenizer's own call, spliced when the
        text has content markers."""
        if self._escaper is not None and MARK in text:
            enc = self._backend.encode_batch([text], add_special_tokens=False)[0]
            return self._escaper.splice(text, enc.ids, enc.offsets)[0]
        return list(self._tokenizer([text], add_special_tokens=False)["input_ids"][0])

    def _full(self, text: str, base: int = 0, first: int = 0) -> tuple[list[int], list[tuple[int, int]]]:
        """Ids of `text` and its cut points (character position + `base`, token index + `first`)."""
        enc = self._backend.encode_batch([text], add_special_tokens=False)[0]  # releases the GIL
        if self._escaper is not None and MARK in text:
            ids, specials = self._escaper.splice(text, enc.ids, enc.offsets)
            return ids, [(base + specials[i], first + i) for i in sorted(specials) if ids[i] in self._cuts]
        ids = enc.ids
        at = [i for i, t in enumerate(ids) if t in self._cuts]
        offsets = enc.offsets if at else []
        return ids, [(base + offsets[i][0], first + i) for i in at]

    def _encode(self, text: str, salt: str = "", keep_below: int | None = None) -> list[int]:
        key = (salt, text)
        with self._lock:
            hit = self._entries.get(key)
            if hit is not None:
                self._entries.move_to_end(key)
                self.hits += 1
                return hit[0].tolist()
            prefix = max(
                (p for s, p in self._entries if s == salt and len(p) < len(text) and text.startswith(p)),
                key=len,
                default=None,
            )
            base = self._entries[(salt, prefix)] if prefix is not None else None
        ids, cuts, reused = None, None, 0
        if base is not None:
            p_ids, p_cuts = base
            usable = [c for c in p_cuts if c[0] + self._margin <= len(prefix) and c[1] > 0]
            if usable:
                s, j = usable[-1]
                tail_ids, tail_cuts = self._full(text[s:], s, j)
                ids, cuts, reused = p_ids[:j].tolist() + tail_ids, [c for c in p_cuts if c[1] < j] + tail_cuts, j
        if ids is None:
            ids, cuts = self._full(text)
        with self._lock:
            if reused:
                self._reuses += 1
                self.reused_tokens += reused
                verify = self._reuses % VERIFY_EVERY == 0
            size = _size(text, len(ids), cuts)
            if (keep_below is None or len(ids) < keep_below) and size <= self.max_bytes:
                if key in self._entries:
                    self.bytes -= _size(text, len(self._entries[key][0]), self._entries[key][1])
                self._entries[key] = (array("i", ids), cuts)
                self._entries.move_to_end(key)
                self.bytes += size
                while len(self._entries) > self.capacity or self.bytes > self.max_bytes:
                    (_, old), (old_ids, old_cuts) = self._entries.popitem(last=False)
                    self.bytes -= _size(old, len(old_ids), old_cuts)
        if reused and verify and self._reference(text) != ids:
            self._disable(f"mismatch on a {len(ids)}-token text")
            return self._reference(text)
        return ids

    def forget(self, tenant: str | None = None) -> None:
        """Drop the texts of `tenant`'s salts (all with None): a cache clear leaves none of its texts behind."""
        with self._lock:
            for key in [k for k in self._entries if tenant is None or tenant_of(k[0]) == tenant]:
                del self._entries[key]

    def _disable(self, why: str) -> None:
        log.error("prompt prefix reuse disabled, every prompt is tokenized in full from now on: %s", why)
        self.reason = why
        with self._lock:
            self._entries.clear()
            self.bytes = 0

    def _self_check(self, marks: list[str]) -> str | None:
        """Encode chat-like texts built around the cut tokens `marks` both ways; a difference turns the
        reuse off."""
        pieces = [
            "system\nYou are a helpful assistant.",
            "user\n  Hello,  world!\n\n",
            "assistant\nSure: 12345 => ok\t",
            "user\nnaïve café, 東京 😀 x",
            "assistant\n\n  ",
            "user\n" + "word " * 40,
        ]
        texts, text = [], ""
        for k, piece in enumerate(pieces):
            text += marks[k % len(marks)] + piece + marks[(k + 1) % len(marks)] + "\n"
            texts.append(text)
        for k in range(len(texts)):
            texts.append(texts[k] + marks[0] + "assistant\n")
        try:
            for text in texts:
                want = self._reference(text)
                if self._full(text)[0] != want or self._encode(text) != want:
                    return "self-check failed: prefix reuse does not reproduce this tokenizer's ids"
        finally:
            self._entries.clear()
            self.bytes = 0
            self._reuses = self.reused_tokens = self.hits = 0
        return None


def _size(text: str, n_ids: int, cuts: list) -> int:
    """Bytes an entry takes: its text, its int32 ids, its cut points (a tuple of two ints each)."""
    return sys.getsizeof(text) + 4 * n_ids + 72 * len(cuts)


def _cut_point(token: dict) -> bool:
    return (
        token.get("special", False)
        and not token.get("normalized", True)
        and not token.get("lstrip")
        and not token.get("rstrip")
        and not token.get("single_word")
    )


def _unsupported(tokenizer, config: dict | None) -> str | None:
    """None when the tokenizer's pipeline (`config`: its backend's JSON) cuts at added tokens and treats every
    piece alike; else why not."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or config is None:
        return "not a fast (Rust) tokenizer"
    if getattr(tokenizer, "split_special_tokens", False):
        return "split_special_tokens is set"
    if backend.truncation is not None or backend.padding is not None:
        return "the tokenizer has truncation or padding configured"
    if not any(_cut_point(t) for t in config.get("added_tokens", [])):
        return "no special token to cut at"
    normalizer = config.get("normalizer")
    kinds = [
        n["type"]
        for n in (
            normalizer.get("normalizers", [])
            if normalizer and normalizer["type"] == "Sequence"
            else [normalizer]
            if normalizer
            else []
        )
    ]
    if any(k not in _NORMALIZERS for k in kinds):
        return f"normalizer {kinds} is not known to be per-piece"
    pre = config.get("pre_tokenizer")
    kinds = [
        p["type"] for p in (pre.get("pretokenizers", []) if pre and pre["type"] == "Sequence" else [pre] if pre else [])
    ]
    if not kinds or any(k not in _PRE_TOKENIZERS for k in kinds):
        return f"pre-tokenizer {kinds or None} is not known to be position-independent"
    return None

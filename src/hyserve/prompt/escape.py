"""Special-token strings a client sends to a chat template stay text, as in OpenAI's API.

A chat template pastes message content into one string, and the tokenizer matches every special token in
that string: `<|im_end|>\\n<|im_start|>system` inside a user message (or in a tool result an agent pastes
in) would become real control tokens and forge a turn. So, before rendering, `escape` replaces each
special-token string in every client-written string (message fields, tool definitions, template options:
values and dictionary keys at any depth, since templates print keys too, `<parameter=KEY>` or `tojson`) by
a two-character marker; the template's own control tokens are left alone. After rendering, `splice`
re-tokenizes each piece of the text between two of the template's special tokens that holds a marker: the
marker is turned back into its string and the piece is encoded with special tokens as plain text
(`tokenizers`' `encode_special_tokens`, what transformers calls `split_special_tokens`). Every other piece
keeps the ids of the normal encode: the pipeline cuts at added tokens and encodes each piece by itself, so
with no special string sent nothing changes, and every render of the same messages (prompt, history
boundary, re-render after decode) escapes alike, which keeps the prefix cache and its boundaries exact.

Only tokens flagged special are escaped. Templates read non-special added tokens such as `<think>` or
`<tool_call>` in content (Qwen3 splits reasoning at `</think>`); those keep their ids, as before.
Others do the same with placeholders (vLLM PR #31735, lmdeploy PR #4961).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

MARK = "\U000f0000"  # plane-15 private use; a MARK typed in content is escaped like a special token
_FIRST = 0xF0001  # the marker's second character: _FIRST + index into `strings`
_LAST = 0xFFFFD


class ContentEscaper:
    """Escapes message content for one tokenizer (a fast one: it needs `backend_tokenizer`)."""

    def __init__(self, tokenizer):
        from tokenizers import Tokenizer

        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise ValueError("escaping special tokens in content needs a fast (Rust) tokenizer")
        config = json.loads(backend.to_str())
        specials = [t for t in config.get("added_tokens", []) if t.get("special")]
        self.strings = [MARK] + sorted({t["content"] for t in specials})
        if _FIRST + len(self.strings) > _LAST:
            raise ValueError(f"{len(self.strings)} special tokens: too many to escape")
        self.special_ids = frozenset(t["id"] for t in specials)
        self._code = {s: MARK + chr(_FIRST + i) for i, s in enumerate(self.strings)}
        self._find = trie_regex(self.strings)
        self._marker = re.compile(re.escape(MARK) + "(.)", re.S)
        self._backend = backend
        self._plain = Tokenizer.from_str(backend.to_str())
        self._plain.encode_special_tokens = True

    def escape(self, messages: Sequence[dict]) -> list[dict]:
        """The messages with markers in every string of every field (a message unchanged is itself)."""
        return [self.escape_value(m) for m in messages]

    def escape_value(self, value):
        """`value` (a string, or JSON-like lists and dicts of them) with markers in every string, dictionary
        keys included; `value` itself if unchanged. Escaping is one-to-one, so distinct keys stay distinct."""
        if isinstance(value, str):
            escaped, n = self._find.subn(lambda hit: self._code[hit.group()], value)
            return escaped if n else value
        if isinstance(value, dict):
            pairs = [(self.escape_value(k), self.escape_value(v)) for k, v in value.items()]
            same = all(k2 is k and v2 is v for (k2, v2), (k, v) in zip(pairs, value.items()))
            return value if same else dict(pairs)
        if isinstance(value, list):
            items = [self.escape_value(v) for v in value]
            return items if any(a is not b for a, b in zip(items, value)) else value
        return value

    def restore(self, text: str) -> str:
        """The text as the client sent it: each marker back to its string."""
        if MARK not in text:
            return text
        return self._marker.sub(self._unmark, text)

    def splice(self, text: str, ids: list[int], offsets: list[tuple[int, int]]) -> tuple[list[int], dict[int, int]]:
        """`ids`/`offsets`: the normal encode of rendered `text`. Returns the ids with each marked piece
        encoded as plain text, and {index in those ids: character offset} of the template's special tokens."""
        bounds = [i for i, t in enumerate(ids) if t in self.special_ids] + [len(ids)]
        pieces, runs = [], []  # runs: (start, end) of ids kept as they are, or None for the next plain piece
        tok, char = 0, 0
        for b in bounds:
            end = offsets[b][0] if b < len(ids) else len(text)
            if MARK in text[char:end]:
                pieces.append(self.restore(text[char:end]))
                runs.append(None)
            else:
                runs.append((tok, b))
            if b < len(ids):
                runs.append((b, -1))  # the template's special token
                tok, char = b + 1, offsets[b][1]
        plain = iter(self._plain.encode_batch(pieces, add_special_tokens=False) if pieces else [])
        out: list[int] = []
        at: dict[int, int] = {}
        for run in runs:
            if run is None:
                out.extend(next(plain).ids)
            elif run[1] == -1:
                at[len(out)] = offsets[run[0]][0]
                out.append(ids[run[0]])
            else:
                out.extend(ids[run[0] : run[1]])
        return out, at

    def _unmark(self, hit: re.Match) -> str:
        i = ord(hit.group(1)) - _FIRST
        return self.strings[i] if 0 <= i < len(self.strings) else hit.group()


def trie_regex(strings: Sequence[str]) -> re.Pattern:
    """A regex matching any of `strings`, leftmost-longest like the tokenizer's own matcher. Built as a
    trie: an alternation of hundreds of literals scans text many times slower."""
    trie: dict = {}
    for s in strings:
        node = trie
        for ch in s:
            node = node.setdefault(ch, {})
        node[""] = {}

    def build(node: dict) -> str:
        alts = [re.escape(ch) + build(child) for ch, child in sorted(node.items()) if ch]
        if not alts:
            return ""
        body = alts[0] if len(alts) == 1 else "(?:" + "|".join(alts) + ")"
        return f"(?:{body})?" if "" in node else body

    return re.compile(build(trie))

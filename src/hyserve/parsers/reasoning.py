"""Reasoning split out of the answer: the text between `<think>` and `</think>`.

The block is reasoning if the reply opens it at its very start, or if the prompt already did (Qwen3.5's
generation prompt ends with `<think>\\n`; with `enable_thinking: false` it closes the block itself, and the
reply is all answer). A reply cut off inside the block is all reasoning. Tags that could still be arriving
are held back, so the split is the same however the text is chunked.
"""

from __future__ import annotations

from .base import partial_tail

REASONING, CONTENT = "reasoning", "content"


class ThinkParser:
    name = "think"
    start_tag, end_tag = "<think>", "</think>"

    def __init__(self, opened: bool = False):
        self._mode = "reasoning" if opened else "start"  # "start": the reply may still open a block
        self._buf = ""

    @classmethod
    def opened_by(cls, prompt_tail: str) -> bool:
        """Whether a prompt ending in `prompt_tail` (decoded with special tokens) leaves a block open."""
        tail = prompt_tail.rstrip()
        return tail.endswith(cls.start_tag)

    @classmethod
    def detects(cls, template: str) -> bool:
        return cls.end_tag in template

    def feed(self, text: str) -> list[tuple[str, str]]:
        """(channel, text) pieces, channel "reasoning" or "content"."""
        if self._mode == "content":
            return [(CONTENT, text)] if text else []
        self._buf += text
        out: list[tuple[str, str]] = []
        if self._mode == "start":
            head = self._buf.lstrip()
            if head.startswith(self.start_tag):
                self._mode, self._buf = "reasoning", head[len(self.start_tag) :]
            elif self.start_tag.startswith(head):
                return out
            else:
                self._mode = "content"
                out.append((CONTENT, self._buf))
                self._buf = ""
                return out
        i = self._buf.find(self.end_tag)
        if i >= 0:
            if i:
                out.append((REASONING, self._buf[:i]))
            rest = self._buf[i + len(self.end_tag) :]
            self._mode, self._buf = "content", ""
            if rest:
                out.append((CONTENT, rest))
            return out
        cut = len(self._buf) - partial_tail(self._buf, self.end_tag)
        if cut:
            out.append((REASONING, self._buf[:cut]))
            self._buf = self._buf[cut:]
        return out

    def finish(self) -> list[tuple[str, str]]:
        buf, self._buf = self._buf, ""
        if not buf:
            return []
        return [(REASONING if self._mode == "reasoning" else CONTENT, buf)]

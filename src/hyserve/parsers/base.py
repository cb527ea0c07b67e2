"""What every tool-call parser shares: the parsed call, the streaming interface, and the generic stream over
`<open>…</close>` blocks that the tag-delimited formats (Hermes JSON, Qwen XML) are built on.

A parser is fed the reply's content text as it is generated and returns, for each piece, content text and
whole tool calls. A block is held back until its closing tag (or the end of the reply) and is a tool call
only if it parses; one that does not comes back as content, tags and all. So a streamed reply carries exactly
what the same reply gives unstreamed, whatever the chunking, and malformed output never fails a request.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as a string (the OpenAI API's `function.arguments`)
    id: str = ""


Piece = str | ToolCall  # content text, or a parsed call


@dataclass
class ToolSchemas:
    """The request's tools by name: parsers that read typeless text (XML parameters) convert values with it."""

    params: dict[str, dict[str, dict]] = field(default_factory=dict)  # function name -> parameter -> JSON schema
    roots: dict[str, dict] = field(default_factory=dict)  # function name -> its whole parameters schema ($defs)

    @classmethod
    def of(cls, tools: list[dict] | None) -> ToolSchemas:
        params, roots = {}, {}
        for tool in tools or []:
            fn = tool.get("function") or {}
            root = fn.get("parameters")
            root = root if isinstance(root, dict) else {}
            props = root.get("properties")
            params[fn.get("name", "")] = props if isinstance(props, dict) else {}
            roots[fn.get("name", "")] = root
        return cls(params, roots)


class ToolParser:
    """Base of the tool-call parsers: `feed` content text as it comes, then `finish` once at the end."""

    name = ""

    def __init__(self, schemas: ToolSchemas | None = None):
        self.schemas = schemas or ToolSchemas()

    def feed(self, text: str) -> list[Piece]:
        raise NotImplementedError

    def finish(self) -> list[Piece]:
        raise NotImplementedError

    @classmethod
    def detects(cls, template: str) -> bool:
        """Whether a chat template's text asks the model for this format."""
        return False


def partial_tail(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper beginning of `tag` (it may be the tag's start)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class TaggedBlocks(ToolParser):
    """Content around `<open>…</close>` blocks; `parse_block(body)` turns one block into calls, or None."""

    open_tag = "<tool_call>"
    close_tag = "</tool_call>"

    def __init__(self, schemas: ToolSchemas | None = None):
        super().__init__(schemas)
        self._buf = ""
        self._in_block = False
        self._scanned = 0  # how far into a held block the close tag was already looked for

    def parse_block(self, body: str, closed: bool) -> list[ToolCall] | None:
        raise NotImplementedError

    def feed(self, text: str) -> list[Piece]:
        self._buf += text
        out: list[Piece] = []
        while True:
            if not self._in_block:
                i = self._buf.find(self.open_tag)
                if i < 0:
                    keep = partial_tail(self._buf, self.open_tag)
                    cut = len(self._buf) - keep
                    if cut:
                        out.append(self._buf[:cut])
                    self._buf = self._buf[cut:]
                    return out
                if i:
                    out.append(self._buf[:i])
                self._buf, self._in_block = self._buf[i:], True
                self._scanned = len(self.open_tag)
            j = self._buf.find(self.close_tag, self._scanned)
            if j < 0:
                self._scanned = max(len(self.open_tag), len(self._buf) - len(self.close_tag) + 1)
                return out
            end = j + len(self.close_tag)
            out += self._block(self._buf[:end], self._buf[len(self.open_tag) : j], closed=True)
            self._buf, self._in_block = self._buf[end:], False

    def finish(self) -> list[Piece]:
        buf, self._buf = self._buf, ""
        if self._in_block:
            self._in_block = False
            return self._block(buf, buf[len(self.open_tag) :], closed=False)
        return [buf] if buf else []

    def _block(self, raw: str, body: str, closed: bool) -> list[Piece]:
        try:
            calls = self.parse_block(body, closed)
        except (ValueError, TypeError, KeyError, AttributeError, RecursionError):
            calls = None
        return list(calls) if calls else [raw]

    @classmethod
    def detects(cls, template: str) -> bool:
        return cls.open_tag in template and cls.close_tag in template


def arguments_json(args) -> str | None:
    """`function.arguments` for a parsed value: a JSON object as a string; None when it is not an object."""
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except (ValueError, RecursionError):
            return None
    if not isinstance(args, dict):
        return None
    return json.dumps(args, ensure_ascii=False)


def valid_name(name) -> bool:
    return isinstance(name, str) and 0 < len(name) <= 256 and not any(c.isspace() for c in name)


Factory = Callable[[ToolSchemas], ToolParser]

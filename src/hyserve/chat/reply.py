"""One reply's text read into reasoning, answer and tool calls, streamed or whole, by one code path.

The reasoning parser splits the text first; only the answer goes to the tool-call parser (a `<tool_call>`
written while thinking is not a call). Each channel is trimmed of leading and trailing whitespace, and
whitespace is held back until more text follows, so the streamed pieces of a channel join to exactly the
unstreamed value, whatever the chunking. Calls get their index and id here. With no parser at all the
text passes through untouched.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field, replace

from ..parsers.base import ToolCall, ToolParser
from ..parsers.reasoning import CONTENT, REASONING, ThinkParser


@dataclass(frozen=True)
class TextEvent:
    channel: str  # "content" | "reasoning"
    text: str


@dataclass(frozen=True)
class CallEvent:
    index: int
    call: ToolCall


@dataclass
class ParsedReply:
    content: str | None  # None when the reply is only tool calls
    reasoning: str | None  # None when there was none (or no reasoning parser)
    tool_calls: list[ToolCall] = field(default_factory=list)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class _Trim:
    """Strips a channel's leading whitespace and holds trailing whitespace until more text follows."""

    def __init__(self):
        self.started, self.held = False, ""

    def __call__(self, text: str) -> str:
        if not self.started:
            text = text.lstrip()
            if not text:
                return ""
            self.started = True
        text = self.held + text
        body = text.rstrip()
        self.held = text[len(body) :]
        return body


class ReplyReader:
    def __init__(
        self, reasoning: ThinkParser | None = None, tools: ToolParser | None = None, parallel_tool_calls: bool = True
    ):
        self.reasoning, self.tools, self.parallel = reasoning, tools, parallel_tool_calls
        trim = reasoning is not None or tools is not None
        self._trim = {CONTENT: _Trim(), REASONING: _Trim()} if trim else None
        self.calls = 0

    def feed(self, text: str) -> list[TextEvent | CallEvent]:
        pieces = self.reasoning.feed(text) if self.reasoning else [(CONTENT, text)]
        return self._route(pieces, final=False)

    def finish(self) -> list[TextEvent | CallEvent]:
        return self._route(self.reasoning.finish() if self.reasoning else [], final=True)

    def _route(self, pieces, final: bool) -> list[TextEvent | CallEvent]:
        out: list[TextEvent | CallEvent] = []
        for channel, text in pieces:
            if channel == CONTENT and self.tools is not None:
                out += self._content(self.tools.feed(text))
            else:
                out += self._text(channel, text)
        if final and self.tools is not None:
            out += self._content(self.tools.finish())
        return out

    def _content(self, pieces) -> list[TextEvent | CallEvent]:
        out: list[TextEvent | CallEvent] = []
        for piece in pieces:
            if isinstance(piece, ToolCall):
                if self.parallel or self.calls == 0:
                    out.append(CallEvent(self.calls, replace(piece, id=piece.id or new_call_id())))
                    self.calls += 1
            else:
                out += self._text(CONTENT, piece)
        return out

    def _text(self, channel: str, text: str) -> list[TextEvent]:
        if self._trim is not None:
            text = self._trim[channel](text)
        return [TextEvent(channel, text)] if text else []


def read_reply(text: str, reader: ReplyReader) -> ParsedReply:
    """The whole reply at once (a fresh `reader`): what its streamed events join to."""
    parts = {CONTENT: [], REASONING: []}
    calls: list[ToolCall] = []
    for ev in reader.feed(text) + reader.finish():
        if isinstance(ev, CallEvent):
            calls.append(ev.call)
        else:
            parts[ev.channel].append(ev.text)
    content = "".join(parts[CONTENT])
    reasoning = "".join(parts[REASONING])
    return ParsedReply(
        content if content or not calls else None,
        reasoning if reasoning and reader.reasoning is not None else None,
        calls,
    )

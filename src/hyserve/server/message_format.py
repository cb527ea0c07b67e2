"""Anthropic's message object and stream events (`POST /v1/messages`, routes in `routes/messages.py`): the
reply is read by the request's `ChatTurn` into `thinking`, `text` and `tool_use` blocks, streamed as
Anthropic's named events. `usage.input_tokens` counts the prompt tokens not read from the prefix cache,
`cache_read_input_tokens` the ones that were (Anthropic's split, the same in message_start, which therefore
waits for the first token); errors come in Anthropic's shape (`errors.ANTHROPIC`)."""

from __future__ import annotations

import json
import uuid

from ..chat import ChatTurn
from ..chat.reply import CallEvent, ParsedReply
from ..engine import SHUTTING_DOWN, Delta, Finished
from .errors import ANTHROPIC
from .formats import Format
from .message_schemas import MessagesRequest


def _tool_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def _input(arguments: str) -> dict:
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def content_blocks(reply: ParsedReply) -> list[dict]:
    out = [{"type": "thinking", "thinking": reply.reasoning, "signature": ""}] if reply.reasoning else []
    out += [{"type": "text", "text": reply.content}] if reply.content else []
    return out + [
        {"type": "tool_use", "id": _tool_id(c.id), "name": c.name, "input": _input(c.arguments)}
        for c in reply.tool_calls
    ]


class MessagesFormat(Format):
    """The message object and its stream: message_start, content blocks (start, deltas, stop), message_delta
    with the stop reason and the final usage, message_stop."""

    done = None

    def __init__(self, model: str, turn: ChatTurn, body: MessagesRequest, prompt_tokens: int, stop_of):
        super().__init__(model)
        self.id = f"msg_{uuid.uuid4().hex}"
        self.turn, self.body, self.prompt_tokens, self.stop_of = turn, body, prompt_tokens, stop_of
        self.reader = turn.reader()
        self.blocks = 0  # content blocks started
        self.open: str | None = None  # "thinking" | "text": the block being streamed
        self.calls = False
        self.started = False  # message_start waits for the engine's first item, which knows the cached tokens

    def event(self, chunk: dict) -> dict:
        return {"event": chunk["type"], "data": json.dumps(chunk)}

    def failure(self, message: str, type_: str, code: str | None) -> list[dict]:
        """Anthropic's `error` event, its type from the status a request failing so would get."""
        status = 408 if type_ == "timeout" else 503 if code == SHUTTING_DOWN else 500
        return [ANTHROPIC.body(status, message, type_)]

    def message(self, content: list[dict], stop_reason: str | None, stop_sequence: str | None, usage: dict) -> dict:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": stop_reason,
            "stop_sequence": stop_sequence,
            "usage": usage,
        }

    def _start(self, cached: int) -> list[dict]:
        """message_start, once, with the usage split the final one has (Anthropic's: input_tokens excludes
        the cached tokens, cache_read_input_tokens counts them)."""
        if self.started:
            return []
        self.started = True
        usage = {**input_usage(self.prompt_tokens, cached), "output_tokens": 0}
        return [{"type": "message_start", "message": self.message([], None, None, usage)}]

    def delta(self, d: Delta) -> list[dict]:
        return self._start(d.cached_tokens) + [e for ev in self.reader.feed(d.text) for e in self._stream(ev)]

    def final(self, fin: Finished) -> list[dict]:
        events = self._start(fin.cached_tokens)
        events += [e for ev in self.reader.finish() for e in self._stream(ev)] + self._close()
        reason, seq = self.stop(fin, self.calls)
        return events + [
            {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": seq}, "usage": usage_of(fin)},
            {"type": "message_stop"},
        ]

    def response(self, fins: list[Finished], formats: list[Format]) -> dict:
        fin = fins[0]
        reply = self.turn.parse(fin.text)
        return self.message(content_blocks(reply), *self.stop(fin, bool(reply.tool_calls)), usage_of(fin))

    def stop(self, fin: Finished, calls: bool) -> tuple[str, str | None]:
        if fin.reason == "length":
            return "max_tokens", None
        if calls:
            return "tool_use", None
        seq = self.stop_of(fin)
        return ("stop_sequence", seq) if seq is not None else ("end_turn", None)

    def _stream(self, ev) -> list[dict]:
        if isinstance(ev, CallEvent):
            self.calls = True
            closed = self._close()
            idx, self.blocks = self.blocks, self.blocks + 1
            block = {"type": "tool_use", "id": _tool_id(ev.call.id), "name": ev.call.name, "input": {}}
            return closed + [
                {"type": "content_block_start", "index": idx, "content_block": block},
                {
                    "type": "content_block_delta",
                    "index": idx,
                    "delta": {"type": "input_json_delta", "partial_json": json.dumps(_input(ev.call.arguments))},
                },
                {"type": "content_block_stop", "index": idx},
            ]
        kind = "thinking" if ev.channel == "reasoning" else "text"
        events = self._close() if self.open not in (None, kind) else []
        if self.open is None:
            self.open, self.blocks = kind, self.blocks + 1
            start = (
                {"type": "thinking", "thinking": "", "signature": ""}
                if kind == "thinking"
                else {"type": "text", "text": ""}
            )
            events.append({"type": "content_block_start", "index": self.blocks - 1, "content_block": start})
        delta = (
            {"type": "thinking_delta", "thinking": ev.text}
            if kind == "thinking"
            else {"type": "text_delta", "text": ev.text}
        )
        return events + [{"type": "content_block_delta", "index": self.blocks - 1, "delta": delta}]

    def _close(self) -> list[dict]:
        if self.open is None:
            return []
        events = []
        if self.open == "thinking":
            events.append(
                {
                    "type": "content_block_delta",
                    "index": self.blocks - 1,
                    "delta": {"type": "signature_delta", "signature": ""},
                }
            )
        self.open = None
        return events + [{"type": "content_block_stop", "index": self.blocks - 1}]


def input_usage(prompt_tokens: int, cached: int) -> dict:
    return {"input_tokens": prompt_tokens - cached, "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def usage_of(fin: Finished) -> dict:
    return {**input_usage(fin.prompt_tokens, fin.cached_tokens), "output_tokens": len(fin.token_ids)}

"""The Responses API's response object and stream events: the reply is read by the request's `ChatTurn`
into reasoning, message and function-call output items. A stream ends with `response.completed`,
`response.incomplete` or, when generation fails, `response.failed`. (The routes: `routes/responses.py`.)"""

from __future__ import annotations

import json
import uuid

from ..chat import ChatTurn
from ..chat.reply import CallEvent, ParsedReply
from ..engine import Delta, Finished
from ..parsers.reasoning import REASONING
from .formats import Format
from .response_schemas import ResponsesRequest

FAILED_CODE = "server_error"  # the failed response's `error.code` (the spec's codes name no timeout or shutdown)


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def reasoning_item(text: str, rid: str | None = None, status: str = "completed") -> dict:
    return {
        "id": rid or _id("rs"),
        "type": "reasoning",
        "summary": [],
        "status": status,
        "content": [{"type": "reasoning_text", "text": text}] if text else [],
    }


def message_item(text: str, mid: str | None = None, status: str = "completed") -> dict:
    return {
        "id": mid or _id("msg"),
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if text else [],
    }


def call_item(call, arguments: str | None = None, status: str = "completed") -> dict:
    return {
        "id": "fc_" + call.id.removeprefix("call_"),
        "type": "function_call",
        "call_id": call.id,
        "name": call.name,
        "arguments": call.arguments if arguments is None else arguments,
        "status": status,
    }


def output_items(reply: ParsedReply) -> list[dict]:
    out = [reasoning_item(reply.reasoning)] if reply.reasoning else []
    out += [message_item(reply.content)] if reply.content else []
    return out + [call_item(c) for c in reply.tool_calls]


class ResponsesFormat(Format):
    """The response object and its stream of named events (`response.created` ... `response.completed`)."""

    done = None  # no `[DONE]` line: the stream ends after `response.completed`

    def __init__(self, model: str, turn: ChatTurn, body: ResponsesRequest, on_done, decode):
        super().__init__(model)
        self.id, self.turn, self.body, self.on_done = _id("resp"), turn, body, on_done
        self.decode = decode  # token ids -> text, as the engine decodes them (to count reasoning tokens)
        self.reader = turn.reader()
        self.seq = 0
        self.output: list[dict] = []  # streamed items, closed
        self.open: dict | None = None  # the item being streamed: {"item", "text"}

    def event(self, chunk: dict) -> dict:
        return {"event": chunk["type"], "data": json.dumps(chunk)}

    def _ev(self, type_: str, **fields) -> dict:
        self.seq += 1
        return {"type": type_, "sequence_number": self.seq - 1, **fields}

    def start(self) -> list[dict]:
        snapshot = self.snapshot("in_progress", [])
        return [self._ev("response.created", response=snapshot), self._ev("response.in_progress", response=snapshot)]

    def delta(self, d: Delta) -> list[dict]:
        return [e for ev in self.reader.feed(d.text) for e in self._stream(ev)]

    def final(self, fin: Finished) -> list[dict]:
        events = [e for ev in self.reader.finish() for e in self._stream(ev)] + self._close()
        resp = self.finished(fin, self.output)
        return events + [
            self._ev("response.completed" if resp["status"] == "completed" else "response.incomplete", response=resp)
        ]

    def failure(self, message: str, type_: str, code: str | None) -> list[dict]:
        """`response.failed`, whose response holds the items streamed so far (the open one incomplete)."""
        if self.open is not None:
            item, text, idx = self.open["item"], self.open["text"], self.open["index"]
            make = reasoning_item if item["type"] == "reasoning" else message_item
            self.output[idx], self.open = make(text, item["id"], "incomplete"), None
        error = {"code": FAILED_CODE, "message": message}
        return [self._ev("response.failed", response=self.snapshot("failed", self.output, error=error))]

    def response(self, fins: list[Finished], formats: list[Format]) -> dict:
        return self.finished(fins[0], output_items(self.turn.parse(fins[0].text)))

    # -- streaming: one open item at a time, closed when the channel changes or a call follows ------------
    def _stream(self, ev) -> list[dict]:
        if isinstance(ev, CallEvent):
            item = call_item(ev.call, "", "in_progress")
            idx, done = len(self.output), call_item(ev.call)  # (the same id: both derive it from the call's)
            self.output.append(done)
            closed = self._close()  # the open text item first: its events come before this call's
            return closed + [
                self._ev("response.output_item.added", output_index=idx, item=item),
                self._ev(
                    "response.function_call_arguments.delta",
                    item_id=item["id"],
                    output_index=idx,
                    delta=ev.call.arguments,
                ),
                self._ev(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=idx,
                    name=ev.call.name,
                    arguments=ev.call.arguments,
                ),
                self._ev("response.output_item.done", output_index=idx, item=done),
            ]
        kind = "reasoning" if ev.channel == "reasoning" else "message"
        events = []
        if self.open is not None and self.open["item"]["type"] != kind:
            events += self._close()
        if self.open is None:
            events += self._start(kind)
        self.open["text"] += ev.text
        item, idx = self.open["item"], self.open["index"]
        name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra = {} if kind == "reasoning" else {"logprobs": []}
        return events + [self._ev(name, item_id=item["id"], output_index=idx, content_index=0, delta=ev.text, **extra)]

    def _part(self, kind: str, text: str) -> dict:
        if kind == "reasoning":
            return {"type": "reasoning_text", "text": text}
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def _start(self, kind: str) -> list[dict]:
        item = (reasoning_item if kind == "reasoning" else message_item)("", status="in_progress")
        idx = len(self.output)
        self.open = {"item": item, "text": "", "index": idx}
        self.output.append(item)  # replaced by the finished item on close
        return [
            self._ev("response.output_item.added", output_index=idx, item=item),
            self._ev(
                "response.content_part.added",
                item_id=item["id"],
                output_index=idx,
                content_index=0,
                part=self._part(kind, ""),
            ),
        ]

    def _close(self) -> list[dict]:
        if self.open is None:
            return []
        item, text, idx = self.open["item"], self.open["text"], self.open["index"]
        self.open = None
        kind = item["type"]
        done = (reasoning_item if kind == "reasoning" else message_item)(text, item["id"])
        self.output[idx] = done
        name = "response.reasoning_text.done" if kind == "reasoning" else "response.output_text.done"
        extra = {} if kind == "reasoning" else {"logprobs": []}
        return [
            self._ev(name, item_id=item["id"], output_index=idx, content_index=0, text=text, **extra),
            self._ev(
                "response.content_part.done",
                item_id=item["id"],
                output_index=idx,
                content_index=0,
                part=self._part(kind, text),
            ),
            self._ev("response.output_item.done", output_index=idx, item=done),
        ]

    # -- the response object --------------------------------------------------------------------------------
    def finished(self, fin: Finished, output: list[dict]) -> dict:
        status = "incomplete" if fin.reason in ("length", "cancelled") else "completed"
        resp = self.snapshot(status, output, fin)
        self.on_done(fin, resp)
        return resp

    def snapshot(self, status: str, output: list[dict], fin: Finished | None = None, error: dict | None = None) -> dict:
        """The response object as it stands (`fin`: the finished generation, None before it)."""
        b = self.body
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "model": self.model,
            "status": status,
            "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if fin and fin.reason == "length" else None,
            "instructions": b.instructions,
            "max_output_tokens": b.max_output_tokens,
            "metadata": b.metadata or {},
            "output": output,
            "parallel_tool_calls": b.parallel_tool_calls,
            "previous_response_id": b.previous_response_id,
            "reasoning": b.reasoning.model_dump() if b.reasoning else None,
            "store": b.store,
            "temperature": b.temperature,
            "text": b.text_options(),
            "tool_choice": b.tool_choice.model_dump()
            if hasattr(b.tool_choice, "model_dump")
            else (b.tool_choice or "auto"),
            "tools": [echoed_tool(t) for t in b.tools or []],
            "top_p": b.top_p,
            "truncation": "disabled",
            "usage": response_usage(fin, reasoning_tokens(self.turn, self.decode, fin.token_ids)) if fin else None,
        }


def echoed_tool(tool) -> dict:
    """A function tool as the response echoes it: `strict` and `parameters` are required there (null when
    the request left them out); other fields only when given."""
    return {"strict": None, "parameters": None, **tool.model_dump(exclude_none=True)}


def reasoning_tokens(turn: ChatTurn, decode, ids: list[int]) -> int:
    """The generated tokens up to and including the one that closes the reasoning block (all of them when the
    reply was cut off inside it), as the request's reasoning parser splits the reply."""
    reader = turn.reader().reasoning
    if reader is None or not ids:
        return 0
    text = decode(ids)
    if not any(channel == REASONING for channel, _ in reader.feed(text) + reader.finish()):
        return 0
    end = text.find(reader.end_tag)
    if end < 0:
        return len(ids)
    end += len(reader.end_tag)
    lo, hi = 1, len(ids)  # the shortest prefix whose text reaches the end tag's end
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if len(decode(ids[:mid])) >= end else (mid + 1, hi)
    return lo


def response_usage(fin: Finished, reasoning: int = 0) -> dict:
    out = len(fin.token_ids)
    # cache_write_tokens: required; hyserve records its checkpoints as a side effect and counts no input as
    # written (as /v1/messages reports cache_creation_input_tokens: 0)
    return {
        "input_tokens": fin.prompt_tokens,
        "input_tokens_details": {"cached_tokens": fin.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": out,
        "output_tokens_details": {"reasoning_tokens": reasoning},
        "total_tokens": fin.prompt_tokens + out,
    }

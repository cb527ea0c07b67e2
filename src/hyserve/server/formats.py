"""The JSON of each endpoint's responses and stream chunks. Chat replies are read (reasoning, answer, tool
calls) by the request's `ChatTurn`: streamed through one reader, whole through `ChatTurn.parse`, which
give the same message."""

from __future__ import annotations

import json
import time
import uuid

from ..chat import CallEvent, ChatTurn, TextEvent
from ..chat.messages import assistant_message
from ..engine import Delta, Finished


class _Format:
    """Builds one endpoint's JSON. `__call__(kind, payload)`: kind 'start', 'delta' and 'final' give a list of
    stream chunks, 'usage' the usage chunk, 'full' the whole response."""

    object_name = full_object = prefix = ""
    done: str | None = "[DONE]"  # the stream's last data line, if any

    def event(self, chunk: dict) -> dict:
        """One stream chunk as a server-sent event (Responses and Messages name their events)."""
        return {"data": json.dumps(chunk)}

    def error_event(self, message: str, type_: str, code: str | None) -> dict:
        return {"data": json.dumps({"error": {"message": message, "type": type_, "param": None, "code": code}})}

    def __init__(self, model: str, token_ids: bool = False):
        self.model, self.token_ids = model, token_ids
        self.id, self.created = f"{self.prefix}-{uuid.uuid4().hex}", int(time.time())

    def _envelope(self, choices: list, obj: str | None = None) -> dict:
        return {"id": self.id, "object": obj or self.object_name, "created": self.created, "model": self.model,
                "choices": choices}

    def __call__(self, kind: str, payload):
        if kind == "start":
            return self.start()
        if kind == "delta":
            return self.delta(payload)
        if kind == "final":
            return self.final(payload)
        if kind == "usage":
            return {**self._envelope([]), "usage": payload}
        out = self._envelope([self.full(payload)], self.full_object)
        out["usage"] = usage(payload)
        return out

    def _ids(self, choice: dict, ids: list[int] | None) -> dict:
        if self.token_ids and ids is not None:
            choice["token_ids"] = ids
        return choice

    def start(self) -> list[dict]:
        return []

    def delta(self, d: Delta) -> list[dict]:
        raise NotImplementedError

    def final(self, fin: Finished) -> list[dict]:
        raise NotImplementedError

    def full(self, fin: Finished) -> dict:
        raise NotImplementedError


class ChatFormat(_Format):
    object_name, full_object, prefix = "chat.completion.chunk", "chat.completion", "chatcmpl"

    def __init__(self, model: str, token_ids: bool, turn: ChatTurn):
        super().__init__(model, token_ids)
        self.turn = turn
        self.reader = turn.reader()

    def _chunk(self, delta: dict, finish: str | None = None, ids: list[int] | None = None) -> dict:
        return self._envelope([self._ids({"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish},
                                         ids)])

    def start(self) -> list[dict]:
        return [self._chunk({"role": "assistant", "content": ""})]

    def _chunks(self, events, ids: list[int] | None) -> list[dict]:
        deltas = [d for ev in events for d in _deltas(ev)]
        if not deltas and self.token_ids and ids:
            deltas = [{}]  # the ids of text held back still go out with their step
        return [self._chunk(d, ids=ids if i == 0 else []) for i, d in enumerate(deltas)]

    def delta(self, d: Delta) -> list[dict]:
        return self._chunks(self.reader.feed(d.text), d.token_ids)

    def final(self, fin: Finished) -> list[dict]:
        return self._chunks(self.reader.finish(), None) + [
            self._chunk({}, _finish(fin, self.reader.calls > 0), [] if self.token_ids else None)]

    def full(self, fin: Finished) -> dict:
        reply = self.turn.parse(fin.text)
        message = assistant_message(reply)
        if reply.reasoning is not None:
            message["reasoning"] = reply.reasoning  # the name vLLM uses now, next to `reasoning_content`
        return self._ids({"index": 0, "message": message, "logprobs": None,
                          "finish_reason": _finish(fin, bool(reply.tool_calls))}, fin.token_ids)


def _deltas(ev) -> list[dict]:
    if isinstance(ev, TextEvent):
        if ev.channel == "reasoning":
            return [{"reasoning_content": ev.text, "reasoning": ev.text}]
        return [{"content": ev.text}]
    assert isinstance(ev, CallEvent)
    call = ev.call
    return [  # the call's id and name first, then its arguments, as OpenAI streams them
        {"tool_calls": [{"index": ev.index, "id": call.id, "type": "function",
                         "function": {"name": call.name, "arguments": ""}}]},
        {"tool_calls": [{"index": ev.index, "function": {"arguments": call.arguments}}]},
    ]


class CompletionFormat(_Format):
    object_name, full_object, prefix = "text_completion", "text_completion", "cmpl"

    def _choice(self, text: str, ids: list[int] | None, finish: str | None) -> dict:
        return self._ids({"index": 0, "text": text, "logprobs": None, "finish_reason": finish}, ids)

    def start(self) -> list[dict]:
        return [self._envelope([self._choice("", None, None)])]

    def delta(self, d: Delta) -> list[dict]:
        return [self._envelope([self._choice(d.text, d.token_ids, None)])]

    def final(self, fin: Finished) -> list[dict]:
        return [self._envelope([self._choice("", [], _finish(fin))])]

    def full(self, fin: Finished) -> dict:
        return self._choice(fin.text, fin.token_ids, _finish(fin))


def _finish(fin: Finished, tool_calls: bool = False) -> str:
    if fin.reason == "length":
        return "length"
    return "tool_calls" if tool_calls else "stop"


def usage(fin: Finished) -> dict:
    return {
        "prompt_tokens": fin.prompt_tokens,
        "completion_tokens": len(fin.token_ids),
        "total_tokens": fin.prompt_tokens + len(fin.token_ids),
        "prompt_tokens_details": {"cached_tokens": fin.cached_tokens},
    }

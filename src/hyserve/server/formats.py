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


class Format:
    """One reply's JSON in one API's shape. The generation loop (`generation`) asks it for the stream's chunks
    (`start`, `delta`, `final`, `usage_chunks`, `failure`) or for the whole reply (`response`); `event` makes a
    chunk a server-sent event."""

    done: str | None = "[DONE]"  # the stream's last data line, if any
    prefix = ""  # of the reply's id

    def __init__(self, model: str):
        self.model = model
        self.index = 0  # the choice's index (n > 1)
        self.id, self.created = f"{self.prefix}-{uuid.uuid4().hex}", int(time.time())

    def event(self, chunk: dict) -> dict:
        """One stream chunk as a server-sent event (Responses and Messages name their events)."""
        return {"data": json.dumps(chunk)}

    def start(self) -> list[dict]:
        return []

    def delta(self, d: Delta) -> list[dict]:
        raise NotImplementedError

    def final(self, fin: Finished) -> list[dict]:
        raise NotImplementedError

    def usage_chunks(self, usage: dict) -> list[dict]:
        """The chunks carrying a stream's usage once every choice has finished (`stream_options.include_usage`);
        APIs whose final event holds the usage send none."""
        return []

    def failure(self, message: str, type_: str, code: str | None) -> list[dict]:
        """The chunks ending a stream whose generation failed or timed out: OpenAI's error line."""
        return [{"error": {"message": message, "type": type_, "param": None, "code": code}}]

    def response(self, fins: list[Finished], formats: list[Format]) -> dict:
        """The whole (non-streamed) reply: `fins[i]` is choice i's, built by `formats[i]` (this one first)."""
        raise NotImplementedError


class ChoiceFormat(Format):
    """OpenAI's chat and text completions: an envelope around `choices`, one per format."""

    object_name = full_object = ""

    def __init__(self, model: str, token_ids: bool = False, tokenizer=None):
        super().__init__(model)
        self.token_ids = token_ids
        self.tokenizer = tokenizer  # for logprobs: each token's text

    def _envelope(self, choices: list, obj: str | None = None) -> dict:
        return {
            "id": self.id,
            "object": obj or self.object_name,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def usage_chunks(self, usage: dict) -> list[dict]:
        return [{**self._envelope([]), "usage": usage}]

    def response(self, fins: list[Finished], formats: list[Format]) -> dict:
        out = self._envelope([f.choice(fin) for f, fin in zip(formats, fins)], self.full_object)
        out["usage"] = usage(*fins)
        return out

    def choice(self, fin: Finished) -> dict:
        """One finished choice of the whole reply."""
        raise NotImplementedError

    def _ids(self, choice: dict, ids: list[int] | None) -> dict:
        if self.token_ids and ids is not None:
            choice["token_ids"] = ids
        return choice

    def _text(self, token: int) -> str:
        return self.tokenizer.decode([token])


class ChatFormat(ChoiceFormat):
    object_name, full_object, prefix = "chat.completion.chunk", "chat.completion", "chatcmpl"

    def __init__(self, model: str, token_ids: bool, turn: ChatTurn, tokenizer=None):
        super().__init__(model, token_ids, tokenizer)
        self.turn = turn
        self.reader = turn.reader()

    def _chunk(
        self, delta: dict, finish: str | None = None, ids: list[int] | None = None, logprobs: dict | None = None
    ) -> dict:
        return self._envelope(
            [self._ids({"index": self.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}, ids)]
        )

    def _logprobs(self, entries: list | None) -> dict | None:
        """OpenAI's chat shape: {"content": [{token, logprob, bytes, top_logprobs: [...]}], "refusal": None}."""
        if entries is None:
            return None
        return {
            "content": [
                {**self._one(t, lp), "top_logprobs": [self._one(i, v) for i, v in top]} for t, lp, top in entries
            ],
            "refusal": None,
        }

    def _one(self, token: int, logprob: float) -> dict:
        text = self._text(token)
        return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode("utf-8"))}

    def start(self) -> list[dict]:
        return [self._chunk({"role": "assistant", "content": ""})]

    def _chunks(self, events, ids: list[int] | None, logprobs: list | None = None) -> list[dict]:
        deltas = [d for ev in events for d in _deltas(ev)]
        if not deltas and ((self.token_ids and ids) or logprobs):
            deltas = [{}]  # the ids and logprobs of text held back still go out with their step
        lps = self._logprobs(logprobs)
        return [
            self._chunk(d, ids=ids if i == 0 else [], logprobs=lps if i == 0 else None) for i, d in enumerate(deltas)
        ]

    def delta(self, d: Delta) -> list[dict]:
        return self._chunks(self.reader.feed(d.text), d.token_ids, d.logprobs)

    def final(self, fin: Finished) -> list[dict]:
        return self._chunks(self.reader.finish(), None) + [
            self._chunk({}, _finish(fin, self.reader.calls > 0), [] if self.token_ids else None)
        ]

    def choice(self, fin: Finished) -> dict:
        reply = self.turn.parse(fin.text)
        message = {**assistant_message(reply), "refusal": None}  # required (nullable): hyserve never refuses
        if reply.reasoning is not None:
            message["reasoning"] = reply.reasoning  # the name vLLM uses now, next to `reasoning_content`
        return self._ids(
            {
                "index": self.index,
                "message": message,
                "logprobs": self._logprobs(fin.logprobs),
                "finish_reason": _finish(fin, bool(reply.tool_calls)),
            },
            fin.token_ids,
        )


def _deltas(ev) -> list[dict]:
    if isinstance(ev, TextEvent):
        if ev.channel == "reasoning":
            return [{"reasoning_content": ev.text, "reasoning": ev.text}]
        return [{"content": ev.text}]
    assert isinstance(ev, CallEvent)
    call = ev.call
    return [  # the call's id and name first, then its arguments, as OpenAI streams them
        {
            "tool_calls": [
                {"index": ev.index, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": ""}}
            ]
        },
        {"tool_calls": [{"index": ev.index, "function": {"arguments": call.arguments}}]},
    ]


class CompletionFormat(ChoiceFormat):
    object_name, full_object, prefix = "text_completion", "text_completion", "cmpl"

    def __init__(self, model: str, token_ids: bool = False, tokenizer=None, echo: str | None = None):
        super().__init__(model, token_ids, tokenizer)
        self.echo = echo  # the prompt's text, sent ahead of the completion (`echo`)
        self.offset = len(echo or "")  # text_offset of the next token

    def _choice(self, text: str, ids: list[int] | None, finish: str | None, logprobs: dict | None = None) -> dict:
        return self._ids({"index": self.index, "text": text, "logprobs": logprobs, "finish_reason": finish}, ids)

    def _logprobs(self, entries: list | None) -> dict | None:
        """The legacy shape: parallel lists; each top_logprobs dict holds the k most likely and the sampled."""
        if entries is None:
            return None
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token, lp, top in entries:
            text = self._text(token)
            out["tokens"].append(text)
            out["token_logprobs"].append(_finite(lp))
            best = {self._text(i): _finite(v) for i, v in top}
            best.setdefault(text, _finite(lp))
            out["top_logprobs"].append(best)
            out["text_offset"].append(self.offset)
            self.offset += len(text)
        return out

    def start(self) -> list[dict]:
        return [self._envelope([self._choice(self.echo or "", None, None)])]

    def delta(self, d: Delta) -> list[dict]:
        return [self._envelope([self._choice(d.text, d.token_ids, None, self._logprobs(d.logprobs))])]

    def final(self, fin: Finished) -> list[dict]:
        return [self._envelope([self._choice("", [], _finish(fin))])]

    def choice(self, fin: Finished) -> dict:
        return self._choice((self.echo or "") + fin.text, fin.token_ids, _finish(fin), self._logprobs(fin.logprobs))


def _finite(logprob: float) -> float:
    """A banned token's logprob is -inf, which JSON cannot carry: report vLLM's floor instead (NaN too, which
    `max` would pass on)."""
    return logprob if logprob >= -9999.0 else -9999.0


def _finish(fin: Finished, tool_calls: bool = False) -> str:
    if fin.reason == "length":
        return "length"
    return "tool_calls" if tool_calls else "stop"


def usage(*fins: Finished) -> dict:
    """One prompt (shared by the n choices) and every choice's completion tokens."""
    fin, completion = fins[0], sum(len(f.token_ids) for f in fins)
    return {
        "prompt_tokens": fin.prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": fin.prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": fin.cached_tokens},
    }

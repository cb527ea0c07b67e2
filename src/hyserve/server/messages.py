"""`POST /v1/messages` (Anthropic's Messages API) on the chat machinery, so agents that speak it work against
hyserve: the reply is read by the request's `ChatTurn` into `thinking`, `text` and `tool_use` blocks, streamed
as Anthropic's named events. `usage.input_tokens` counts the prompt tokens not read from the prefix cache,
`cache_read_input_tokens` the ones that were (Anthropic's split, the same in message_start, which therefore
waits for the first token); errors come in Anthropic's shape (`errors.anthropic_body`).
`POST /v1/messages/count_tokens` renders without generating."""

from __future__ import annotations

import json
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from ..chat import ChatRequestError, ChatTurn, template_message
from ..chat.reply import CallEvent, ParsedReply
from ..engine import SHUTTING_DOWN, Finished
from ..prompt_bound import PromptTooLong
from ..service import Service
from .errors import APIError, anthropic_body
from .formats import _Format
from .ignored import ignored_headers
from .message_schemas import CountTokensRequest, MessagesRequest, chat_messages


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
    return out + [{"type": "tool_use", "id": _tool_id(c.id), "name": c.name, "input": _input(c.arguments)}
                  for c in reply.tool_calls]


class MessagesFormat(_Format):
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

    def error_event(self, message: str, type_: str, code: str | None) -> dict:
        return self.event(anthropic_body(408 if type_ == "timeout" else 503 if code == SHUTTING_DOWN else 500, message))

    def message(self, content: list[dict], stop_reason: str | None, stop_sequence: str | None, usage: dict) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": usage}

    def _start(self, cached: int) -> list[dict]:
        """message_start, once, with the usage split the final one has (Anthropic's: input_tokens excludes
        the cached tokens, cache_read_input_tokens counts them)."""
        if self.started:
            return []
        self.started = True
        usage = {**input_usage(self.prompt_tokens, cached), "output_tokens": 0}
        return [{"type": "message_start", "message": self.message([], None, None, usage)}]

    def __call__(self, kind: str, payload):
        if kind == "delta":
            return self._start(payload.cached_tokens) + [
                e for ev in self.reader.feed(payload.text) for e in self._stream(ev)]
        if kind == "final":
            events = self._start(payload.cached_tokens)
            events += [e for ev in self.reader.finish() for e in self._stream(ev)] + self._close()
            reason, seq = self.stop(payload, self.calls)
            return events + [{"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": seq},
                              "usage": usage_of(payload)}, {"type": "message_stop"}]
        if kind == "full":
            reply = self.turn.parse(payload.text)
            return self.message(content_blocks(reply), *self.stop(payload, bool(reply.tool_calls)), usage_of(payload))
        return []

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
                {"type": "content_block_delta", "index": idx,
                 "delta": {"type": "input_json_delta", "partial_json": json.dumps(_input(ev.call.arguments))}},
                {"type": "content_block_stop", "index": idx}]
        kind = "thinking" if ev.channel == "reasoning" else "text"
        events = self._close() if self.open not in (None, kind) else []
        if self.open is None:
            self.open, self.blocks = kind, self.blocks + 1
            start = {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" else \
                {"type": "text", "text": ""}
            events.append({"type": "content_block_start", "index": self.blocks - 1, "content_block": start})
        delta = {"type": "thinking_delta", "thinking": ev.text} if kind == "thinking" else \
            {"type": "text_delta", "text": ev.text}
        return events + [{"type": "content_block_delta", "index": self.blocks - 1, "delta": delta}]

    def _close(self) -> list[dict]:
        if self.open is None:
            return []
        events = []
        if self.open == "thinking":
            events.append({"type": "content_block_delta", "index": self.blocks - 1,
                           "delta": {"type": "signature_delta", "signature": ""}})
        self.open = None
        return events + [{"type": "content_block_stop", "index": self.blocks - 1}]


def input_usage(prompt_tokens: int, cached: int) -> dict:
    return {"input_tokens": prompt_tokens - cached, "cache_read_input_tokens": cached,
            "cache_creation_input_tokens": 0}


def usage_of(fin: Finished) -> dict:
    return {**input_usage(fin.prompt_tokens, fin.cached_tokens), "output_tokens": len(fin.token_ids)}


def install_messages(app: FastAPI, service: Service) -> None:
    api, cfg, rt = app.state.api, service.config, service.runtime

    def stop_of(body: MessagesRequest):
        """The stop sequence that ended a reply (None: it ended its turn itself)."""
        def find(fin: Finished) -> str | None:
            if not body.stop or not fin.token_ids or fin.token_ids[-1] in rt.eos_token_ids:
                return None
            tail = rt.tokenizer.decode(fin.token_ids[-16:], skip_special_tokens=False)
            return next((s for s in body.stop if s in tail), None)
        return find

    async def prepare(body: MessagesRequest, request: Request):
        api.check_model(body.model)
        grammar = await api.grammar_of(body)  # vLLM's structured-output fields work here too
        if len(body.messages) > cfg.max_messages:
            raise APIError(400, f"at most {cfg.max_messages} messages per request", param="messages")
        messages = [template_message(m) for m in chat_messages(body)]
        c = body.tool_choice
        try:
            turn = ChatTurn(service.parsers, body.chat_tools(), body.chat_tool_choice(),
                            not (c and c.disable_parallel_tool_use), body.template_options())
        except ChatRequestError as exc:
            raise APIError(400, str(exc), param=exc.param)
        try:
            chat = await run_in_threadpool(service.engine.render_chat, messages, api.salt_of(body, request),
                                           turn.template_kwargs)
        except PromptTooLong as exc:
            raise api.too_long(exc, "messages")
        except Exception as exc:
            raise APIError(400, f"could not apply the chat template: {exc}", param="messages")
        return messages, turn, chat, grammar

    @app.post("/v1/messages")
    async def create_message(body: MessagesRequest, request: Request):
        messages, turn, chat, grammar = await prepare(body, request)
        turn.note_prompt(rt.tokenizer, chat.prompt)
        req = api.build_request(body, chat.prompt, messages, request, chat, api.answer_grammar(grammar, turn))
        req.template_kwargs, req.reply_message = turn.template_kwargs, turn.history_message
        fmt = MessagesFormat(service.model_name, turn, body, len(chat.prompt), stop_of(body))
        return await api.run("messages", body, req, request, lambda: fmt)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(body: CountTokensRequest, request: Request):
        _, _, chat, _ = await prepare(body, request)
        return JSONResponse({"input_tokens": len(chat.prompt)}, headers=ignored_headers(body, "count_tokens"))

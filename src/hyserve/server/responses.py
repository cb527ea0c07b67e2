"""`POST /v1/responses` (OpenAI's Responses API) on the chat machinery: input items become chat messages,
the reply is read by the request's `ChatTurn` into reasoning, message and function-call output items.

`store: true` (the default) keeps the response's tokens (prompt + output, as generated) under the caller's
tenant, and the engine records its state after the very last token (`keep_final`). A request with
`previous_response_id` is then those tokens plus the template's rendering of the new input only
(`chat.continuation`): nothing is re-rendered or re-tokenized, and the prefix cache restores the whole
previous turn, its reply included, on any template. New `tools` are the exception: templates list tools
ahead of the conversation, so the stored conversation (messages) is rendered again with them.
"""

from __future__ import annotations

import json
import uuid

from fastapi import FastAPI, Request
from starlette.concurrency import run_in_threadpool

from ..chat import ChatRequestError, ChatTurn, template_message
from ..chat.continuation import ContinuationError, continuation_ids
from ..chat.reply import CallEvent, ParsedReply
from ..parsers.reasoning import REASONING
from ..engine import Finished
from ..prompt_bound import PromptTooLong
from ..service import Service
from .errors import APIError
from .formats import _Format
from .guards import API_KEY, key_tenant
from .response_schemas import ResponsesRequest, input_messages
from .response_store import ResponseStore

DEFAULT_STORE_BYTES = 64 << 20


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def reasoning_item(text: str, rid: str | None = None, status: str = "completed") -> dict:
    return {"id": rid or _id("rs"), "type": "reasoning", "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}] if text else []}


def message_item(text: str, mid: str | None = None, status: str = "completed") -> dict:
    return {"id": mid or _id("msg"), "type": "message", "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if text else []}


def call_item(call, arguments: str | None = None, status: str = "completed") -> dict:
    return {"id": "fc_" + call.id.removeprefix("call_"), "type": "function_call", "call_id": call.id,
            "name": call.name, "arguments": call.arguments if arguments is None else arguments, "status": status}


def output_items(reply: ParsedReply) -> list[dict]:
    out = [reasoning_item(reply.reasoning)] if reply.reasoning else []
    out += [message_item(reply.content)] if reply.content else []
    return out + [call_item(c) for c in reply.tool_calls]


class ResponsesFormat(_Format):
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

    def error_event(self, message: str, type_: str, code: str | None) -> dict:
        return self.event(self._ev("error", code=code or type_, message=message, param=None))

    def _ev(self, type_: str, **fields) -> dict:
        self.seq += 1
        return {"type": type_, "sequence_number": self.seq - 1, **fields}

    def __call__(self, kind: str, payload):
        if kind == "start":
            snapshot = self.response("in_progress", [])
            return [self._ev("response.created", response=snapshot),
                    self._ev("response.in_progress", response=snapshot)]
        if kind == "delta":
            return [e for ev in self.reader.feed(payload.text) for e in self._stream(ev)]
        if kind == "final":
            events = [e for ev in self.reader.finish() for e in self._stream(ev)] + self._close()
            resp = self.finished(payload, self.output)
            return events + [self._ev("response.completed" if resp["status"] == "completed" else "response.incomplete",
                                      response=resp)]
        if kind == "full":
            return self.finished(payload, output_items(self.turn.parse(payload.text)))
        return []

    # -- streaming: one open item at a time, closed when the channel changes or a call follows ------------
    def _stream(self, ev) -> list[dict]:
        if isinstance(ev, CallEvent):
            item = call_item(ev.call, "", "in_progress")
            idx, done = len(self.output), call_item(ev.call)  # (the same id: both derive it from the call's)
            self.output.append(done)
            closed = self._close()  # the open text item first: its events come before this call's
            return closed + [
                self._ev("response.output_item.added", output_index=idx, item=item),
                self._ev("response.function_call_arguments.delta", item_id=item["id"], output_index=idx,
                         delta=ev.call.arguments),
                self._ev("response.function_call_arguments.done", item_id=item["id"], output_index=idx,
                         name=ev.call.name, arguments=ev.call.arguments),
                self._ev("response.output_item.done", output_index=idx, item=done)]
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
        return [self._ev("response.output_item.added", output_index=idx, item=item),
                self._ev("response.content_part.added", item_id=item["id"], output_index=idx, content_index=0,
                         part=self._part(kind, ""))]

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
        return [self._ev(name, item_id=item["id"], output_index=idx, content_index=0, text=text, **extra),
                self._ev("response.content_part.done", item_id=item["id"], output_index=idx, content_index=0,
                         part=self._part(kind, text)),
                self._ev("response.output_item.done", output_index=idx, item=done)]

    # -- the response object --------------------------------------------------------------------------------
    def finished(self, fin: Finished, output: list[dict]) -> dict:
        status = "incomplete" if fin.reason in ("length", "cancelled") else "completed"
        resp = self.response(status, output, fin)
        self.on_done(fin, resp)
        return resp

    def response(self, status: str, output: list[dict], fin: Finished | None = None) -> dict:
        b = self.body
        return {
            "id": self.id, "object": "response", "created_at": self.created, "model": self.model, "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if fin and fin.reason == "length" else None,
            "instructions": b.instructions, "max_output_tokens": b.max_output_tokens, "metadata": b.metadata or {},
            "output": output, "parallel_tool_calls": b.parallel_tool_calls,
            "previous_response_id": b.previous_response_id,
            "reasoning": b.reasoning.model_dump() if b.reasoning else None, "store": b.store,
            "temperature": b.temperature, "text": b.text_options(),
            "tool_choice": b.tool_choice.model_dump() if hasattr(b.tool_choice, "model_dump")
            else (b.tool_choice or "auto"),
            "tools": [echoed_tool(t) for t in b.tools or []], "top_p": b.top_p, "truncation": "disabled",
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
    return {"input_tokens": fin.prompt_tokens,
            "input_tokens_details": {"cached_tokens": fin.cached_tokens, "cache_write_tokens": 0},
            "output_tokens": out, "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": fin.prompt_tokens + out}


def install_responses(app: FastAPI, service: Service) -> None:
    api, cfg, rt = app.state.api, service.config, service.runtime
    store = app.state.responses = ResponseStore(getattr(cfg, "response_store_bytes", DEFAULT_STORE_BYTES))

    def tenant(request: Request) -> str:
        return key_tenant(request.scope.get(API_KEY) if cfg.api_keys else None)

    def stored(request: Request, rid: str, param: str | None = None):
        item = store.get(tenant(request), rid)
        if item is None:  # another tenant's id reads as unknown
            raise APIError(404, f"Response with id '{rid}' not found.", "invalid_request_error", param,
                           "response_not_found")
        return item

    def render(messages, salt, template_kwargs):
        try:
            return service.engine.render_chat(messages, salt, template_kwargs)
        except PromptTooLong:
            raise
        except Exception as exc:
            raise ContinuationError(f"could not apply the chat template: {exc}") from exc

    @app.post("/v1/responses")
    async def create_response(body: ResponsesRequest, request: Request):
        api.check_model(body.model)
        grammar = await api.grammar_of(body)
        messages = [template_message(m) for m in input_messages(body)]
        if len(messages) > cfg.max_messages:
            raise APIError(400, f"at most {cfg.max_messages} input items per request", param="input")
        try:
            turn = ChatTurn(service.parsers, body.chat_tools(), body.chat_tool_choice(), body.parallel_tool_calls,
                            body.template_options())
        except ChatRequestError as exc:
            raise APIError(400, str(exc), param=exc.param)
        salt, chat, history, earlier = api.salt_of(body, request), None, messages, []
        instructions = body.instructions
        try:
            if body.previous_response_id is not None:
                prev = stored(request, body.previous_response_id, "previous_response_id")
                if instructions is not None and instructions != prev.instructions:
                    raise APIError(400, "instructions cannot change when continuing a response: its tokens "
                                   "already hold the earlier ones", param="instructions")
                # they are in its tokens, so they hold here too (the response reports them)
                instructions = body.instructions = prev.instructions
                earlier = prev.messages or []
                if turn.tools != prev.tools:  # the template lists tools up front: render it all with the new ones
                    history = earlier + messages
                    chat = await run_in_threadpool(render, history, salt, turn.template_kwargs)
                    prompt = chat.prompt
                else:
                    history = None
                    tail = await run_in_threadpool(continuation_ids, rt, messages, prev.tokens, salt,
                                                   turn.template_kwargs)
                    prompt = prev.tokens + tail
            else:
                chat = await run_in_threadpool(render, messages, salt, turn.template_kwargs)
                prompt = chat.prompt
        except PromptTooLong as exc:
            raise api.too_long(exc, "input")
        except ContinuationError as exc:
            raise APIError(400, str(exc), param="input")
        turn.note_prompt(rt.tokenizer, prompt)
        req = api.build_request(body, prompt, history, request, chat, api.answer_grammar(grammar, turn))
        req.template_kwargs, req.reply_message = turn.template_kwargs, turn.history_message
        req.keep_final = body.store
        who = tenant(request)

        def on_done(fin: Finished, resp: dict) -> None:
            if body.store and fin.reason in ("stop", "length"):
                conversation = earlier + messages + [turn.history_message(fin.text)]
                store.put(who, resp["id"], prompt + list(fin.token_ids), resp, instructions, conversation, turn.tools)

        fmt = ResponsesFormat(service.model_name, turn, body, on_done, rt.decode)
        return await api.run("responses", body, req, request, lambda: fmt)

    @app.get("/v1/responses/{rid}")
    async def get_response(rid: str, request: Request):
        return stored(request, rid).response

    @app.delete("/v1/responses/{rid}")
    async def delete_response(rid: str, request: Request):
        stored(request, rid)
        store.delete(tenant(request), rid)
        return {"id": rid, "object": "response.deleted", "deleted": True}


"""`POST /v1/messages` (Anthropic's Messages API) on the chat machinery, so agents that speak it work against
hyserve (the reply's shape: `message_format`); errors come in Anthropic's shape (its router's `errors.ANTHROPIC`).
`POST /v1/messages/count_tokens` renders without generating."""

from __future__ import annotations

from fastapi import Depends, Request
from fastapi.responses import JSONResponse

from ...chat import template_message
from ...engine import Finished
from ..errors import ANTHROPIC
from ..ignored import ignored_headers
from ..message_format import MessagesFormat
from ..message_schemas import CountTokensRequest, MessagesRequest, chat_messages
from ..serving import Serving, serving_of
from . import api_router

router = api_router(ANTHROPIC)


def stop_finder(serving: Serving, body: MessagesRequest):
    """The stop sequence that ended a reply (None: it ended its turn itself)."""
    rt = serving.runtime

    def find(fin: Finished) -> str | None:
        if not body.stop or not fin.token_ids or fin.token_ids[-1] in rt.eos_token_ids:
            return None
        tail = rt.tokenizer.decode(fin.token_ids[-16:], skip_special_tokens=False)
        return next((s for s in body.stop if s in tail), None)

    return find


async def prepare(serving: Serving, body: MessagesRequest, request: Request):
    """The request checked and its prompt rendered: (messages, turn, chat, grammar)."""
    serving.check_model(body.model)
    grammar = await serving.grammar_of(body)  # vLLM's structured-output fields work here too
    serving.check_messages(len(body.messages))
    messages = [template_message(m) for m in chat_messages(body)]
    c = body.tool_choice
    turn = serving.chat_turn(body, not (c and c.disable_parallel_tool_use))
    chat = await serving.render_chat(messages, serving.salt_of(body, request), turn)
    return messages, turn, chat, grammar


@router.post("/v1/messages")
async def create_message(body: MessagesRequest, request: Request, serving: Serving = Depends(serving_of)):
    messages, turn, chat, grammar = await prepare(serving, body, request)
    req = serving.chat_request(body, chat.prompt, messages, request, chat, turn, grammar)
    fmt = MessagesFormat(serving.model_name, turn, body, len(chat.prompt), stop_finder(serving, body))
    return await serving.respond("messages", body, req, request, lambda: fmt)


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: CountTokensRequest, request: Request, serving: Serving = Depends(serving_of)):
    _, _, chat, _ = await prepare(serving, body, request)
    return JSONResponse({"input_tokens": len(chat.prompt)}, headers=ignored_headers(body, "count_tokens"))

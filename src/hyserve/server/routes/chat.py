"""`POST /v1/chat/completions`: messages rendered by the model's chat template, the reply read by the
request's `ChatTurn` (reasoning, content, tool calls) into OpenAI's chat shape, or its legacy `function_call`
when the request sent the deprecated `functions`."""

from __future__ import annotations

from fastapi import Depends, Request

from ...chat import template_message
from ..errors import OPENAI
from ..formats import ChatFormat
from ..legacy import LegacyFunctionsFormat
from ..schemas import ChatCompletionRequest
from ..serving import Serving, serving_of
from . import api_router

router = api_router(OPENAI)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request, serving: Serving = Depends(serving_of)):
    serving.check_model(body.model)
    grammar = await serving.grammar_of(body)
    serving.check_messages(len(body.messages))
    turn = serving.chat_turn(body, body.parallel_tool_calls and not body.legacy_functions)
    messages = [template_message(m.model_dump(exclude_none=True)) for m in body.messages]
    chat = await serving.render_chat(messages, serving.salt_of(body, request), turn)
    req = serving.chat_request(body, chat.prompt, messages, request, chat, turn, grammar)
    fmt = LegacyFunctionsFormat if body.legacy_functions else ChatFormat
    tokenizer = serving.runtime.tokenizer
    return await serving.respond(
        "chat", body, req, request, lambda: fmt(serving.model_name, body.return_token_ids, turn, tokenizer)
    )

"""`POST /v1/responses` (OpenAI's Responses API) on the chat machinery, and its stored responses (GET,
DELETE): input items become chat messages, the reply the output items of `response_format`.

`store: true` (the default) keeps the response's tokens (prompt + output, as generated) under the caller's
tenant, and the engine records its state after the very last token (`keep_final`). A request with
`previous_response_id` is then those tokens plus the template's rendering of the new input only
(`chat.continuation`): nothing is re-rendered or re-tokenized, and the prefix cache restores the whole
previous turn, its reply included, on any template. New `tools` are the exception: templates list tools
ahead of the conversation, so the stored conversation (messages) is rendered again with them.
"""

from __future__ import annotations

from fastapi import Depends, Request
from starlette.concurrency import run_in_threadpool

from ...chat import ChatTurn, template_message
from ...chat.continuation import ContinuationError, continuation_ids
from ...engine import Finished
from ...prompt.bound import PromptTooLong
from ..errors import RESPONSES, APIError
from ..response_format import ResponsesFormat
from ..response_schemas import ResponsesRequest, input_messages
from ..serving import Serving, serving_of
from . import api_router

router = api_router(RESPONSES)


def stored(serving: Serving, request: Request, rid: str, param: str | None = None):
    """The caller's stored response `rid`; another tenant's id reads as unknown."""
    item = serving.responses.get(serving.tenant(request), rid)
    if item is None:
        raise APIError(
            404, f"Response with id '{rid}' not found.", "invalid_request_error", param, "response_not_found"
        )
    return item


def render(serving: Serving, messages: list[dict], salt: str, template_kwargs: dict):
    try:
        return serving.service.engine.render_chat(messages, salt, template_kwargs)
    except PromptTooLong:
        raise
    except Exception as exc:
        raise ContinuationError(f"could not apply the chat template: {exc}") from exc


async def prompt_of(serving: Serving, body: ResponsesRequest, request: Request, messages: list[dict], turn: ChatTurn):
    """(prompt ids, rendered chat or None, history to record or None, earlier conversation): the input rendered
    alone, or continuing the stored `previous_response_id`."""
    salt = serving.salt_of(body, request)
    if body.previous_response_id is None:
        chat = await run_in_threadpool(render, serving, messages, salt, turn.template_kwargs)
        return chat.prompt, chat, messages, []
    prev = stored(serving, request, body.previous_response_id, "previous_response_id")
    if body.instructions is not None and body.instructions != prev.instructions:
        raise APIError(
            400,
            "instructions cannot change when continuing a response: its tokens already hold the earlier ones",
            param="instructions",
        )
    body.instructions = prev.instructions  # they are in its tokens, so they hold here too (the response reports them)
    earlier = prev.messages or []
    if turn.tools != prev.tools:  # the template lists tools up front: render it all with the new ones
        history = earlier + messages
        chat = await run_in_threadpool(render, serving, history, salt, turn.template_kwargs)
        return chat.prompt, chat, history, earlier
    tail = await run_in_threadpool(continuation_ids, serving.runtime, messages, prev.tokens, salt, turn.template_kwargs)
    return prev.tokens + tail, None, None, earlier


@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, request: Request, serving: Serving = Depends(serving_of)):
    serving.check_model(body.model)
    grammar = await serving.grammar_of(body)
    messages = [template_message(m) for m in input_messages(body)]
    serving.check_messages(len(messages), "input", "input items")
    turn = serving.chat_turn(body, body.parallel_tool_calls)
    try:
        prompt, chat, history, earlier = await prompt_of(serving, body, request, messages, turn)
    except PromptTooLong as exc:
        raise serving.too_long(exc, "input") from exc
    except ContinuationError as exc:
        raise APIError(400, str(exc), param="input") from exc
    req = serving.chat_request(body, prompt, history, request, chat, turn, grammar)
    req.keep_final = body.store
    who, instructions = serving.tenant(request), body.instructions

    def on_done(fin: Finished, resp: dict) -> None:
        if body.store and fin.reason in ("stop", "length"):
            conversation = earlier + messages + [turn.history_message(fin.text)]
            serving.responses.put(
                who, resp["id"], prompt + list(fin.token_ids), resp, instructions, conversation, turn.tools
            )

    fmt = ResponsesFormat(serving.model_name, turn, body, on_done, serving.runtime.decode)
    return await serving.respond("responses", body, req, request, lambda: fmt)


@router.get("/v1/responses/{rid}")
async def get_response(rid: str, request: Request, serving: Serving = Depends(serving_of)):
    return stored(serving, request, rid).response


@router.delete("/v1/responses/{rid}")
async def delete_response(rid: str, request: Request, serving: Serving = Depends(serving_of)):
    stored(serving, request, rid)
    serving.responses.delete(serving.tenant(request), rid)
    return {"id": rid, "object": "response.deleted", "deleted": True}

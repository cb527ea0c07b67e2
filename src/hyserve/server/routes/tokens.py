"""vLLM's /tokenize and /detokenize: the served model's tokenizer over HTTP, so a client can count a prompt
exactly as the completion routes will (same rendering, same tokenization) without running the model."""

from __future__ import annotations

from fastapi import Depends, Request
from starlette.concurrency import run_in_threadpool

from ...chat import ChatRequestError, ChatTurn, template_message
from ...prompt.bound import PromptTooLong, check_length
from ..errors import OPENAI, APIError
from ..schemas import DetokenizeRequest, TokenizeRequest
from ..serving import Serving, serving_of
from . import api_router

router = api_router(OPENAI)


def tokenize(serving: Serving, body: TokenizeRequest, salt: str) -> list[int]:
    """The ids the completion routes would run: the prompt encoded, or the messages rendered."""
    rt = serving.runtime
    if body.messages is None:
        if body.add_special_tokens is False:  # exactly the ids /v1/completions runs for this prompt
            return rt.encode(body.prompt, salt)
        check_length(len(body.prompt), rt.chars_per_token, rt.max_model_len)
        return list(rt.tokenizer(body.prompt, add_special_tokens=True)["input_ids"])
    try:
        turn = ChatTurn(
            serving.service.parsers,
            [t.model_dump(exclude_none=True) for t in body.tools or []] or None,
            None,
            True,
            dict(body.chat_template_kwargs or {}),
        )
    except ChatRequestError as exc:
        raise APIError(400, str(exc), param=exc.param) from exc
    messages = [template_message(m.model_dump(exclude_none=True)) for m in body.messages]
    try:
        ids = rt.render_chat(messages, body.add_generation_prompt, salt, turn.template_kwargs)
    except (PromptTooLong, APIError):
        raise
    except Exception as exc:
        raise APIError(400, f"could not apply the chat template: {exc}", param="messages") from exc
    return list(ids)


@router.post("/tokenize")
async def tokenize_route(body: TokenizeRequest, request: Request, serving: Serving = Depends(serving_of)):
    if body.model is not None:
        serving.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "give exactly one of prompt and messages", param="prompt")
    if body.messages is not None and body.add_special_tokens:  # the chat template places them
        raise APIError(400, "add_special_tokens is not supported with messages", param="add_special_tokens")
    try:
        ids = await run_in_threadpool(tokenize, serving, body, serving.salt_of(None, request))
    except PromptTooLong as exc:
        raise APIError(
            400, str(exc), param="messages" if body.messages else "prompt", code="context_length_exceeded"
        ) from exc
    rt = serving.runtime
    out = {"count": len(ids), "max_model_len": rt.max_model_len, "tokens": ids}
    if body.return_token_strs:
        out["token_strs"] = rt.tokenizer.convert_ids_to_tokens(ids)
    return out


@router.post("/detokenize")
async def detokenize_route(body: DetokenizeRequest, serving: Serving = Depends(serving_of)):
    if body.model is not None:
        serving.check_model(body.model)
    rt = serving.runtime
    vocab = len(rt.tokenizer)
    bad = [t for t in body.tokens if not 0 <= t < vocab]
    if bad:
        raise APIError(400, f"token id {bad[0]} is outside the vocabulary [0, {vocab})", param="tokens")
    return {"prompt": rt.tokenizer.decode(body.tokens)}

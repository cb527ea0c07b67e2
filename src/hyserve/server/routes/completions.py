"""`POST /v1/completions`: a text prompt (tokenized as the prefix cache keys it) or token ids, continued
as is; `echo` sends the prompt's text ahead of the completion."""

from __future__ import annotations

from fastapi import Depends, Request
from starlette.concurrency import run_in_threadpool

from ...prompt.bound import PromptTooLong
from ..errors import OPENAI, APIError
from ..formats import CompletionFormat
from ..schemas import CompletionRequest
from ..serving import Serving, serving_of
from . import api_router

router = api_router(OPENAI)


async def prompt_ids(serving: Serving, body: CompletionRequest, request: Request) -> list[int]:
    """The prompt's token ids: the text encoded off the event loop, or the ids given, checked."""
    rt = serving.runtime
    if isinstance(body.prompt, str):
        try:
            return await run_in_threadpool(rt.encode, body.prompt, serving.salt_of(body, request))
        except PromptTooLong as exc:
            raise serving.too_long(exc, "prompt") from exc
    vocab = len(rt.tokenizer)
    if any(t < 0 or t >= vocab for t in body.prompt):
        raise APIError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
    return list(body.prompt)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request, serving: Serving = Depends(serving_of)):
    serving.check_model(body.model)
    grammar = await serving.grammar_of(body)
    prompt = await prompt_ids(serving, body, request)
    if not prompt:
        raise APIError(400, "prompt encodes to zero tokens", param="prompt")
    if body.echo and body.logprobs is not None:  # would need the prompt's own logprobs (not computed)
        raise APIError(400, "echo together with logprobs is not supported", param="echo")
    req = serving.build_request(body, prompt, None, request, grammar=grammar)
    rt = serving.runtime
    echo = (body.prompt if isinstance(body.prompt, str) else rt.decode(prompt)) if body.echo else None
    return await serving.respond(
        "completions",
        body,
        req,
        request,
        lambda: CompletionFormat(serving.model_name, body.return_token_ids, rt.tokenizer, echo),
    )

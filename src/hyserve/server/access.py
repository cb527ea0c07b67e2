"""The access line: every HTTP request is logged once its response is done, with its generation's
tokens and timings when it ran one. Routes hand those over through the request's scope (`track`)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from ..engine import Failed, Finished, GenerationRequest
from ..logs import log_access

REQUEST_ID = "hyserve.request_id"  # scope entries `track` leaves for the access line
OUTCOME = "hyserve.outcome"  # (Finished or Failed, seconds from arrival to its delivery)


async def track(scope: dict, req: GenerationRequest, items: AsyncIterator[object]) -> AsyncIterator[object]:
    """Pass the engine's items through, noting the request's id and its Finished or Failed item."""
    scope[REQUEST_ID] = req.request_id
    try:
        async for item in items:
            if isinstance(item, (Finished, Failed)):
                scope[OUTCOME] = (item, time.perf_counter() - req.arrival)
            yield item
    finally:
        close = getattr(items, "aclose", None)
        if close is not None:
            await close()  # leaving early still cancels the request (the engine's stream does that)


def generation_fields(scope: dict) -> dict:
    """Request id, tokens, TTFT (s), decode speed (tokens/s after the first) and finish reason; None
    for what the request never reached."""
    fields = {
        "id": scope.get(REQUEST_ID),
        "prompt_tokens": None,
        "cached_tokens": None,
        "generated_tokens": None,
        "ttft_s": None,
        "decode_tok_s": None,
        "finish": None,
    }
    item, elapsed = scope.get(OUTCOME, (None, None))
    if isinstance(item, Failed):
        fields["finish"] = "error"
    elif isinstance(item, Finished):
        n = len(item.token_ids)
        fields.update(
            prompt_tokens=item.prompt_tokens, cached_tokens=item.cached_tokens, generated_tokens=n, finish=item.reason
        )
        if item.ttft is not None:
            fields["ttft_s"] = round(item.ttft, 3)
            decoding = elapsed - item.ttft
            if n > 1 and decoding > 0:
                fields["decode_tok_s"] = round((n - 1) / decoding, 1)
    return fields


class AccessLogMiddleware:
    """Outermost ASGI layer: sees every status, the guards' 401/413/503 included."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, status = time.perf_counter(), None

        async def noting_send(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, noting_send)
        finally:
            client = scope.get("client")
            fields = generation_fields(scope) if scope.get(REQUEST_ID) else {}
            fields["duration_s"] = round(time.perf_counter() - start, 3)
            log_access(
                f"{client[0]}:{client[1]}" if client else "-",
                scope.get("method", "-"),
                scope.get("path", ""),
                scope.get("http_version", "1.1"),
                status,
                fields,
            )

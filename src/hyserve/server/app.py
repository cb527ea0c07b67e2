"""The OpenAI-compatible HTTP layer. It validates, renders prompts and formats responses; the engine
does everything that touches the model."""

from __future__ import annotations

import asyncio
import json
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from sse_starlette.sse import EventSourceResponse
from starlette.concurrency import run_in_threadpool

from ..engine import Delta, Failed, Finished, GenerationRequest
from ..sampling import SamplingParams
from ..service import Service
from .errors import APIError, install_handlers
from .schemas import ChatCompletionRequest, CompletionRequest, SamplingFields


def create_app(service: Service) -> FastAPI:
    app = FastAPI(title="hyserve", docs_url=None, redoc_url=None)
    install_handlers(app)
    app.state.service = service
    metrics = service.metrics
    rt = service.runtime

    def check_model(name: str) -> None:
        if name != service.model_name:
            raise APIError(404, f"The model `{name}` does not exist. Available: {service.model_name}",
                           "not_found_error", "model", "model_not_found")

    def build_request(body: SamplingFields, prompt: list[int], messages: list[dict] | None) -> GenerationRequest:
        room = rt.max_model_len - len(prompt)
        wanted = body.requested_max_tokens()
        if room <= 0 or (wanted is not None and wanted > room):
            raise APIError(
                400,
                f"This model's maximum context length is {rt.max_model_len} tokens. However, you requested "
                f"{len(prompt) + (wanted or 0)} tokens ({len(prompt)} in the messages, {wanted or 0} in the completion).",
                param="messages" if messages is not None else "prompt", code="context_length_exceeded",
            )
        sampling = SamplingParams(temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, seed=body.seed)
        return GenerationRequest(prompt=prompt, max_tokens=wanted or room, sampling=sampling, stop=body.stop,
                                 messages=messages)

    async def run(endpoint: str, body: SamplingFields, req: GenerationRequest, request: Request, fmt):
        """fmt(kind, payload) builds the endpoint's JSON; kind is 'delta', 'final' or 'full'."""
        rid = fmt.id
        if body.stream:
            async def events():
                status = "ok"
                try:
                    yield {"data": json.dumps(fmt("start", None))}
                    async for item in service.engine.stream(req):
                        if isinstance(item, Delta):
                            yield {"data": json.dumps(fmt("delta", item.text))}
                        elif isinstance(item, Finished):
                            yield {"data": json.dumps(fmt("final", item))}
                            if body.include_usage:
                                yield {"data": json.dumps(fmt("usage", _usage(item)))}
                        elif isinstance(item, Failed):
                            status = "error"
                            yield {"data": json.dumps({"error": {"message": item.message, "type": "server_error",
                                                                 "param": None, "code": None}})}
                    yield {"data": "[DONE]"}
                except asyncio.CancelledError:
                    status = "cancelled"
                    raise
                finally:
                    metrics.requests.labels(endpoint, status).inc()
            return EventSourceResponse(events(), ping=15, headers={"X-Request-Id": rid})

        async def watch_disconnect():
            while not req.cancelled.is_set():
                if await request.is_disconnected():
                    req.cancelled.set()
                    return
                await asyncio.sleep(0.05)

        watcher = asyncio.create_task(watch_disconnect())
        try:
            result = None
            async for item in service.engine.stream(req):
                if isinstance(item, (Finished, Failed)):
                    result = item
        finally:
            watcher.cancel()
        if isinstance(result, Failed) or result is None:
            metrics.requests.labels(endpoint, "error").inc()
            raise APIError(500, result.message if result else "generation failed", "server_error")
        metrics.requests.labels(endpoint, "cancelled" if result.reason == "cancelled" else "ok").inc()
        return JSONResponse(fmt("full", result), headers={"X-Request-Id": rid})

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_model(body.model)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            prompt = await run_in_threadpool(rt.render_chat, messages, True)
        except Exception as exc:
            raise APIError(400, f"could not apply the chat template: {exc}", param="messages")
        req = build_request(body, prompt, messages)
        return await run("chat", body, req, request, _ChatFormat(service.model_name))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_model(body.model)
        if isinstance(body.prompt, str):
            prompt = await run_in_threadpool(rt.encode, body.prompt)
        else:
            vocab = len(rt.tokenizer)
            if any(t < 0 or t >= vocab for t in body.prompt):
                raise APIError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
            prompt = list(body.prompt)
        if not prompt:
            raise APIError(400, "prompt encodes to zero tokens", param="prompt")
        req = build_request(body, prompt, None)
        return await run("completions", body, req, request, _CompletionFormat(service.model_name))

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": service.model_name, "object": "model", "created": int(time.time()), "owned_by": "hyserve",
            "max_model_len": rt.max_model_len,
        }]}

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": service.model_name}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/cache")
    async def cache_stats():
        return service.cache.stats()

    @app.get("/v1/cache/events")
    async def cache_events(limit: int = 100):
        return {"events": list(service.cache.telemetry.recent)[-max(0, limit):]}

    @app.delete("/v1/cache")
    async def cache_clear():
        def clear():
            with rt.lock:
                return service.cache.clear()
        removed = await run_in_threadpool(clear)
        return {"cleared": removed, **service.cache.stats()}

    return app


class _ChatFormat:
    def __init__(self, model: str):
        self.model, self.id, self.created = model, f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

    def _chunk(self, delta: dict, finish=None) -> dict:
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}

    def __call__(self, kind: str, payload):
        if kind == "start":
            return self._chunk({"role": "assistant", "content": ""})
        if kind == "delta":
            return self._chunk({"content": payload})
        if kind == "final":
            return self._chunk({}, _finish(payload))
        if kind == "usage":
            return {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                    "choices": [], "usage": payload}
        fin: Finished = payload
        return {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": fin.text},
                             "logprobs": None, "finish_reason": _finish(fin)}],
                "usage": _usage(fin)}


class _CompletionFormat:
    def __init__(self, model: str):
        self.model, self.id, self.created = model, f"cmpl-{uuid.uuid4().hex}", int(time.time())

    def _body(self, text: str, finish=None) -> dict:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}

    def __call__(self, kind: str, payload):
        if kind == "start":
            return self._body("")
        if kind == "delta":
            return self._body(payload)
        if kind == "final":
            return self._body("", _finish(payload))
        if kind == "usage":
            return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                    "choices": [], "usage": payload}
        out = self._body(payload.text, _finish(payload))
        out["usage"] = _usage(payload)
        return out


def _finish(fin: Finished) -> str:
    return "length" if fin.reason == "length" else "stop"


def _usage(fin: Finished) -> dict:
    return {
        "prompt_tokens": fin.prompt_tokens,
        "completion_tokens": len(fin.token_ids),
        "total_tokens": fin.prompt_tokens + len(fin.token_ids),
        "prompt_tokens_details": {"cached_tokens": fin.cached_tokens},
    }

"""The OpenAI-compatible HTTP layer. It validates, renders prompts and formats responses; the engine
does everything that touches the model."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from types import SimpleNamespace

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from sse_starlette.sse import EventSourceResponse
from starlette.concurrency import run_in_threadpool

from ..cache.namespace import tenant_of
from ..chat import ChatRequestError, ChatTurn, template_message
from ..engine import SHUTTING_DOWN, ChatPrompt, Delta, Failed, Finished, GenerationRequest, QueueFull
from ..grammar import GrammarError, Grammars
from ..prompt_bound import PromptTooLong
from ..sampling import SamplingParams
from ..service import Service
from .access import AccessLogMiddleware, track
from .errors import APIError, install_handlers
from .choices import merged, siblings
from .formats import ChatFormat, CompletionFormat, full_response, usage
from .guards import API_KEY, GuardMiddleware, cache_scope, tenant_salt
from .ignored import ignored_headers
from .legacy import LegacyFunctionsFormat
from .messages import install_messages
from .openapi_doc import install_openapi
from .responses import install_responses
from .schemas import ChatCompletionRequest, CompletionRequest, SamplingFields
from .strict_json import StrictJSONRoute
from .tokens import install_tokens
from .structured import constraint_of


def create_app(service: Service) -> FastAPI:
    app = FastAPI(title="hyserve", docs_url=None, redoc_url=None)
    app.router.route_class = StrictJSONRoute
    install_handlers(app)
    install_openapi(app)
    app.add_middleware(GuardMiddleware, service=service)
    app.add_middleware(AccessLogMiddleware)  # added last: outermost, it logs the guards' refusals too
    app.state.service = service
    metrics = service.metrics
    rt = service.runtime

    def check_model(name: str) -> None:
        if name != service.model_name:
            raise APIError(404, f"The model `{name}` does not exist. Available: {service.model_name}",
                           "not_found_error", "model", "model_not_found")

    cfg = service.config
    vocab = rt.model.config.get_text_config().vocab_size  # the logits' width (ids past the tokenizer's masked)
    grammars = Grammars(rt.tokenizer, vocab, rt.eos_token_ids)

    async def grammar_of(body: SamplingFields):
        """The request's checked constraint (None without one), compiled off the event loop; a 400 naming
        the field when it is invalid."""
        spec = constraint_of(body)
        if spec is None:
            return None
        try:
            return await run_in_threadpool(grammars.compile, spec)
        except GrammarError as exc:
            raise APIError(400, str(exc), param=exc.param)

    def answer_grammar(grammar, turn: ChatTurn):
        """A chat reply that reasons first is constrained in its answer only (after the reasoning's end tag)."""
        if grammar is None or not turn.reasoning_opened:
            return grammar
        end_tag = service.parsers.reasoning.end_tag
        return replace(grammar, after=tuple(rt.tokenizer.encode(end_tag, add_special_tokens=False)))

    def salt_of(body: SamplingFields, request: Request) -> str:
        """The tenant's namespace for every cache a request can warm (prefix cache, tokenizer reuse)."""
        return tenant_salt(request.scope.get(API_KEY) if cfg.api_keys else None, body.cache_salt)

    def too_long(exc: PromptTooLong, param: str) -> APIError:
        return APIError(400, str(exc), param=param, code="context_length_exceeded")

    def build_request(body: SamplingFields, prompt: list[int], messages: list[dict] | None,
                      request: Request, chat: ChatPrompt | None = None, grammar=None) -> GenerationRequest:
        room = rt.max_model_len - len(prompt)
        wanted = body.requested_max_tokens()
        if cfg.max_tokens_cap and (wanted or 0) > cfg.max_tokens_cap:
            field = body.max_tokens_param()
            raise APIError(400, f"{field} is capped at {cfg.max_tokens_cap} on this server", param=field)
        if room <= 0 or (wanted is not None and wanted > room):
            raise APIError(
                400,
                f"This model's maximum context length is {rt.max_model_len} tokens. However, you requested "
                f"{len(prompt) + (wanted or 0)} tokens ({len(prompt)} in the messages, {wanted or 0} in the completion).",
                param="messages" if messages is not None else "prompt", code="context_length_exceeded",
            )
        max_tokens = wanted or min(room, cfg.max_tokens_cap or room)
        sampling = sampling_params(body, max_tokens)
        return GenerationRequest(prompt=prompt, max_tokens=max_tokens, sampling=sampling, stop=body.stop,
                                 messages=messages, chat=chat, cache_salt=salt_of(body, request),
                                 timeout=cfg.request_timeout, grammar=grammar)

    def vocab_size() -> int:
        """Token ids a request may name: the tokenizer's, within the model's logits row."""
        rows = getattr(rt.model.config.get_text_config(), "vocab_size", None) or len(rt.tokenizer)
        return min(len(rt.tokenizer), rows)

    def token_ids(ids, param: str) -> list[int]:
        vocab = vocab_size()
        bad = [t for t in ids if not 0 <= int(t) < vocab]
        if bad:
            raise APIError(400, f"{param}: token id {bad[0]} is outside the vocabulary [0, {vocab})", param=param)
        return [int(t) for t in ids]

    def sampling_params(body: SamplingFields, max_tokens: int) -> SamplingParams:
        """The request's sampling and logits-processor fields, checked against this model."""
        if body.min_tokens > max_tokens:
            raise APIError(400, f"min_tokens ({body.min_tokens}) is more than max_tokens ({max_tokens})",
                           param="min_tokens")
        if isinstance(body, ChatCompletionRequest) and body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        bias = body.logit_bias or {}
        ids = token_ids([int(k) for k in bias], "logit_bias")
        return SamplingParams(
            temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, seed=body.seed,
            logit_bias=tuple(zip(ids, [float(v) for v in bias.values()])),
            presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
            repetition_penalty=body.repetition_penalty, min_tokens=body.min_tokens,
            stop_token_ids=tuple(token_ids(body.stop_token_ids or [], "stop_token_ids")),
            logprobs=body.logprobs_wanted())

    async def run(endpoint: str, body: SamplingFields, req: GenerationRequest, request: Request, make_fmt):
        """make_fmt() builds one choice's JSON (fmt(kind, payload), kind 'start', 'delta', 'final' or 'full');
        `body.n` choices share req's prefill."""
        reqs = siblings(req, body.n)
        fmts = [make_fmt() for _ in reqs]
        rid = req.request_id = fmts[0].id  # one id in headers, responses and cache events
        headers = {"X-Request-Id": rid, **ignored_headers(body, endpoint)}
        for i, (r, fmt) in enumerate(zip(reqs, fmts)):
            fmt.id, fmt.created, fmt.index = rid, fmts[0].created, i
            if i:
                r.request_id = f"{rid}-{i}"
            service.cache.telemetry.bind(r.request_id, tenant_of(r.cache_salt))  # its events are its tenant's
        streams = []
        try:
            for i, r in enumerate(reqs):
                stream = service.engine.stream(r)
                streams.append(track(request.scope, r, stream) if i == 0 else stream)  # for the access line
        except QueueFull as exc:
            for r in reqs:
                r.cancelled.set()
            metrics.requests.labels(endpoint, "rejected").inc()
            raise APIError(429, str(exc), "rate_limit_error", None, "rate_limit_exceeded")
        items = merged(streams)

        def cancel_all():
            for r in reqs:
                r.cancelled.set()

        if body.stream:
            async def events():
                status, finals = "ok", [None] * len(reqs)
                try:
                    for fmt in fmts:
                        for chunk in fmt("start", None):
                            yield fmt.event(chunk)
                    async for i, item in items:
                        if isinstance(item, Delta):
                            for chunk in fmts[i]("delta", item):
                                yield fmts[i].event(chunk)
                        elif isinstance(item, Finished) and item.reason == "timeout":
                            status = "timeout"
                            yield fmts[0].error_event("request timed out", "timeout", "request_timeout")
                        elif isinstance(item, Finished):
                            finals[i] = item
                            for chunk in fmts[i]("final", item):
                                yield fmts[i].event(chunk)
                            if body.include_usage and all(finals):
                                yield fmts[0].event(fmts[0]("usage", usage(*finals)))
                        elif isinstance(item, Failed):
                            status = "error"
                            yield fmts[0].error_event(item.message, "server_error", item.code)
                    if fmts[0].done is not None:
                        yield {"data": fmts[0].done}
                except asyncio.CancelledError:
                    status = "cancelled"
                    raise
                finally:
                    cancel_all()
                    await items.aclose()
                    metrics.requests.labels(endpoint, status).inc()
            return EventSourceResponse(events(), ping=15, headers=headers)

        async def watch_disconnect():
            while not req.cancelled.is_set():
                if await request.is_disconnected():
                    cancel_all()
                    return
                await asyncio.sleep(0.05)

        watcher = asyncio.create_task(watch_disconnect())
        results: list = [None] * len(reqs)
        try:
            async for i, item in items:
                if isinstance(item, (Finished, Failed)):
                    results[i] = item
        finally:
            watcher.cancel()
            cancel_all()
            await items.aclose()
        failed = next((r for r in results if isinstance(r, Failed) or r is None), False)
        if failed is not False:
            metrics.requests.labels(endpoint, "error").inc()
            if failed and failed.code == SHUTTING_DOWN:
                raise APIError(503, failed.message, "server_error", None, SHUTTING_DOWN)
            raise APIError(500, failed.message if failed else "generation failed", "server_error")
        if any(r.reason == "timeout" for r in results):
            metrics.requests.labels(endpoint, "timeout").inc()
            raise APIError(408, f"request timed out after {cfg.request_timeout} s", "timeout", None, "request_timeout")
        cancelled = any(r.reason == "cancelled" for r in results)
        metrics.requests.labels(endpoint, "cancelled" if cancelled else "ok").inc()
        return JSONResponse(full_response(fmts, results), headers=headers)

    # the Responses and Messages routes reuse this machinery (server/responses.py, server/messages.py)
    app.state.api = SimpleNamespace(check_model=check_model, salt_of=salt_of, too_long=too_long,
                                    build_request=build_request, run=run, grammar_of=grammar_of,
                                    answer_grammar=answer_grammar)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_model(body.model)
        grammar = await grammar_of(body)
        if len(body.messages) > cfg.max_messages:
            raise APIError(400, f"at most {cfg.max_messages} messages per request", param="messages")
        try:
            turn = ChatTurn(service.parsers, body.chat_tools(), body.chat_tool_choice(),
                            body.parallel_tool_calls and not body.legacy_functions, body.template_options())
        except ChatRequestError as exc:
            raise APIError(400, str(exc).replace("tool_choice", body.choice_param(exc.param)),
                           param=body.choice_param(exc.param))
        messages = [template_message(m.model_dump(exclude_none=True)) for m in body.messages]
        try:
            chat = await run_in_threadpool(service.engine.render_chat, messages, salt_of(body, request),
                                           turn.template_kwargs)
        except PromptTooLong as exc:
            raise too_long(exc, "messages")
        except Exception as exc:
            raise APIError(400, f"could not apply the chat template: {exc}", param="messages")
        turn.note_prompt(rt.tokenizer, chat.prompt)
        req = build_request(body, chat.prompt, messages, request, chat, answer_grammar(grammar, turn))
        req.template_kwargs, req.reply_message = turn.template_kwargs, turn.history_message
        fmt = LegacyFunctionsFormat if body.legacy_functions else ChatFormat
        return await run("chat", body, req, request,
                         lambda: fmt(service.model_name, body.return_token_ids, turn, rt.tokenizer))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_model(body.model)
        grammar = await grammar_of(body)
        if isinstance(body.prompt, str):
            try:
                prompt = await run_in_threadpool(rt.encode, body.prompt, salt_of(body, request))
            except PromptTooLong as exc:
                raise too_long(exc, "prompt")
        else:
            vocab = len(rt.tokenizer)
            if any(t < 0 or t >= vocab for t in body.prompt):
                raise APIError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
            prompt = list(body.prompt)
        if not prompt:
            raise APIError(400, "prompt encodes to zero tokens", param="prompt")
        if body.echo and body.logprobs is not None:  # would need the prompt's own logprobs (not computed)
            raise APIError(400, "echo together with logprobs is not supported", param="echo")
        req = build_request(body, prompt, None, request)
        echo = (body.prompt if isinstance(body.prompt, str) else rt.decode(prompt)) if body.echo else None
        req = build_request(body, prompt, None, request, grammar=grammar)
        return await run("completions", body, req, request,
                         lambda: CompletionFormat(service.model_name, body.return_token_ids, rt.tokenizer, echo))

    install_tokens(app, service, check_model)

    created = int(time.time())  # the model is loaded once: its "created" stays the same while serving

    def model_object() -> dict:
        return {"id": service.model_name, "object": "model", "created": created, "owned_by": "hyserve",
                "max_model_len": rt.max_model_len}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_object()]}

    @app.get("/v1/models/{model:path}")  # (ids such as "Qwen/Qwen3.5-4B" hold a slash)
    async def model(model: str):
        check_model(model)
        return model_object()

    @app.get("/health")
    async def health():
        # The service exists only once the model is loaded; while draining, load balancers should stop.
        if service.draining:
            return JSONResponse({"status": "draining", "model": service.model_name}, status_code=503)
        # degraded: the engine's steps keep failing or one has hung; an orchestrator should restart it
        problem = service.engine.problem()
        if problem is not None:
            return JSONResponse({"status": "degraded", "model": service.model_name, "idle": service.engine.idle,
                                 "reason": problem}, status_code=503)
        # idle: nothing queued, running or left for idle time (benchmarks wait for it between turns)
        # kernels: each of hyserve's kernels "on", or "off: why" (the load-time check against transformers)
        return {"status": "ok", "model": service.model_name, "idle": service.engine.idle,
                "kernels": rt.kernels.status}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")

    # The cache routes act on the caller's own tenant; the admin key (or a server without keys) on all.
    def under_lock(fn, *args):  # the engine changes the tree while it runs
        def call():
            with rt.lock:
                return fn(*args)
        return run_in_threadpool(call)

    @app.get("/v1/cache")
    async def cache_stats(request: Request):
        tenant = cache_scope(request.scope, cfg)
        return await under_lock(service.cache.stats, tenant)  # (a clear's dead checkpoints are walked past)

    @app.get("/v1/cache/events")
    async def cache_events(request: Request, limit: int = 100):
        return {"events": service.cache.telemetry.events(cache_scope(request.scope, cfg), limit)}

    @app.delete("/v1/cache")
    async def cache_clear(request: Request):
        tenant = cache_scope(request.scope, cfg)
        removed = await under_lock(service.engine.clear_cache, tenant)
        return {"cleared": removed, **(await under_lock(service.cache.stats, tenant))}

    install_responses(app, service)
    install_messages(app, service)
    return app

"""What every API surface shares, in one object per app (`app.state.serving`, read by `serving_of`): the
model-name check, the tenant's cache salt, chat-turn and prompt rendering with their errors, structured-output
grammars, the checks and sampling parameters that make a `GenerationRequest`, and the generation that answers
it (`generation.Generation`). The routes (`routes/`) validate, render and format; the engine does the rest."""

from __future__ import annotations

import time
from dataclasses import replace

from fastapi import Request
from starlette.concurrency import run_in_threadpool

from ..chat import ChatRequestError, ChatTurn
from ..engine import ChatPrompt, GenerationRequest
from ..engine.grammar import GrammarError, Grammars
from ..engine.sampling import SamplingParams
from ..prompt.bound import PromptTooLong
from ..service import Service
from .errors import APIError
from .generation import Generation
from .guards import API_KEY, key_tenant, tenant_salt
from .response_store import ResponseStore
from .schemas import ChatCompletionRequest, SamplingFields
from .structured import constraint_of

DEFAULT_STORE_BYTES = 64 << 20  # stored Responses-API responses, per server


class Serving:
    def __init__(self, service: Service):
        self.service, self.config, self.runtime, self.metrics = (
            service,
            service.config,
            service.runtime,
            service.metrics,
        )
        rt = self.runtime
        vocab = rt.model.config.get_text_config().vocab_size  # the logits' width (ids past the tokenizer's masked)
        self.grammars = Grammars(rt.tokenizer, vocab, rt.eos_token_ids)
        self.created = int(time.time())  # the model is loaded once: its "created" stays the same while serving
        self.responses = ResponseStore(getattr(self.config, "response_store_bytes", DEFAULT_STORE_BYTES))

    @property
    def model_name(self) -> str:
        return self.service.model_name

    # -- the request's model, tenant and size ------------------------------------------------------------
    def check_model(self, name: str) -> None:
        if name != self.model_name:
            raise APIError(
                404,
                f"The model `{name}` does not exist. Available: {self.model_name}",
                "not_found_error",
                "model",
                "model_not_found",
            )

    def api_key(self, request: Request) -> str | None:
        """The configured API key the request presented (checked by `guards`); None on a server without keys."""
        return request.scope.get(API_KEY) if self.config.api_keys else None

    def salt_of(self, body: SamplingFields | None, request: Request) -> str:
        """The tenant's namespace for every cache a request can warm (prefix cache, tokenizer reuse)."""
        return tenant_salt(self.api_key(request), body.cache_salt if body is not None else None)

    def tenant(self, request: Request) -> str:
        """The caller's tenant (whose stored responses it may read)."""
        return key_tenant(self.api_key(request))

    def check_messages(self, count: int, param: str = "messages", what: str = "messages") -> None:
        if count > self.config.max_messages:
            raise APIError(400, f"at most {self.config.max_messages} {what} per request", param=param)

    @staticmethod
    def too_long(exc: PromptTooLong, param: str) -> APIError:
        return APIError(400, str(exc), param=param, code="context_length_exceeded")

    # -- chat: the turn, its prompt, its grammar ---------------------------------------------------------
    def chat_turn(self, body: SamplingFields, parallel_tool_calls: bool) -> ChatTurn:
        """The request's tools, tool choice and template options read into a `ChatTurn`; a 400 naming the
        field (as the request named it: `function_call` for the legacy form) when they do not fit."""
        try:
            return ChatTurn(
                self.service.parsers,
                body.chat_tools(),
                body.chat_tool_choice(),
                parallel_tool_calls,
                body.template_options(),
            )
        except ChatRequestError as exc:
            param = body.choice_param(exc.param)
            message = str(exc) if param == exc.param else str(exc).replace(exc.param, param)
            raise APIError(400, message, param=param) from exc

    async def render_chat(self, messages: list[dict], salt: str, turn: ChatTurn, param: str = "messages") -> ChatPrompt:
        """The chat prompt, rendered off the event loop; a 400 naming `param` when it is too long or the
        template refuses the messages."""
        try:
            return await run_in_threadpool(self.service.engine.render_chat, messages, salt, turn.template_kwargs)
        except PromptTooLong as exc:
            raise self.too_long(exc, param) from exc
        except Exception as exc:
            raise APIError(400, f"could not apply the chat template: {exc}", param=param) from exc

    async def grammar_of(self, body: SamplingFields):
        """The request's checked constraint (None without one), compiled off the event loop; a 400 naming
        the field when it is invalid."""
        spec = constraint_of(body)
        if spec is None:
            return None
        try:
            return await run_in_threadpool(self.grammars.compile, spec)
        except GrammarError as exc:
            raise APIError(400, str(exc), param=exc.param) from exc

    def answer_grammar(self, grammar, turn: ChatTurn):
        """A chat reply that reasons first is constrained in its answer only (after the reasoning's end tag)."""
        if grammar is None or not turn.reasoning_opened:
            return grammar
        end_tag = self.service.parsers.reasoning.end_tag
        return replace(grammar, after=tuple(self.runtime.tokenizer.encode(end_tag, add_special_tokens=False)))

    def chat_request(
        self,
        body: SamplingFields,
        prompt: list[int],
        history: list[dict] | None,
        request: Request,
        chat: ChatPrompt | None,
        turn: ChatTurn,
        grammar,
    ) -> GenerationRequest:
        """A chat reply's request: the turn's prompt noted, its grammar on the answer, and what the engine needs
        to record the reply as the next turn's history."""
        turn.note_prompt(self.runtime.tokenizer, prompt)
        req = self.build_request(body, prompt, history, request, chat, self.answer_grammar(grammar, turn))
        req.template_kwargs, req.reply_message = turn.template_kwargs, turn.history_message
        return req

    # -- the generation request --------------------------------------------------------------------------
    def build_request(
        self,
        body: SamplingFields,
        prompt: list[int],
        messages: list[dict] | None,
        request: Request,
        chat: ChatPrompt | None = None,
        grammar=None,
    ) -> GenerationRequest:
        """The engine's request: the token budget checked against the context and the server's cap."""
        rt, cfg = self.runtime, self.config
        room = rt.max_model_len - len(prompt)
        wanted = body.requested_max_tokens()
        if cfg.max_tokens_cap and (wanted or 0) > cfg.max_tokens_cap:
            field = body.max_tokens_param()
            raise APIError(400, f"{field} is capped at {cfg.max_tokens_cap} on this server", param=field)
        if room <= 0 or (wanted is not None and wanted > room):
            raise APIError(
                400,
                f"This model's maximum context length is {rt.max_model_len} tokens. However, you requested "
                f"{len(prompt) + (wanted or 0)} tokens ({len(prompt)} in the messages, "
                f"{wanted or 0} in the completion).",
                param="messages" if messages is not None else "prompt",
                code="context_length_exceeded",
            )
        max_tokens = wanted or min(room, cfg.max_tokens_cap or room)
        sampling = self.sampling_params(body, max_tokens)
        return GenerationRequest(
            prompt=prompt,
            max_tokens=max_tokens,
            sampling=sampling,
            stop=body.stop,
            messages=messages,
            chat=chat,
            cache_salt=self.salt_of(body, request),
            timeout=cfg.request_timeout,
            grammar=grammar,
        )

    def vocab_size(self) -> int:
        """Token ids a request may name: the tokenizer's, within the model's logits row."""
        rt = self.runtime
        rows = getattr(rt.model.config.get_text_config(), "vocab_size", None) or len(rt.tokenizer)
        return min(len(rt.tokenizer), rows)

    def token_ids(self, ids, param: str) -> list[int]:
        vocab = self.vocab_size()
        bad = [t for t in ids if not 0 <= int(t) < vocab]
        if bad:
            raise APIError(400, f"{param}: token id {bad[0]} is outside the vocabulary [0, {vocab})", param=param)
        return [int(t) for t in ids]

    def sampling_params(self, body: SamplingFields, max_tokens: int) -> SamplingParams:
        """The request's sampling and logits-processor fields, checked against this model."""
        if body.min_tokens > max_tokens:
            raise APIError(
                400, f"min_tokens ({body.min_tokens}) is more than max_tokens ({max_tokens})", param="min_tokens"
            )
        if isinstance(body, ChatCompletionRequest) and body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        bias = body.logit_bias or {}
        ids = self.token_ids([int(k) for k in bias], "logit_bias")
        return SamplingParams(
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            seed=body.seed,
            logit_bias=tuple(zip(ids, [float(v) for v in bias.values()])),
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            repetition_penalty=body.repetition_penalty,
            min_tokens=body.min_tokens,
            stop_token_ids=tuple(self.token_ids(body.stop_token_ids or [], "stop_token_ids")),
            logprobs=body.logprobs_wanted(),
        )

    async def respond(self, endpoint: str, body: SamplingFields, req: GenerationRequest, request: Request, make_format):
        """Run `req` (with `body.n` choices) and answer in `make_format()`'s shape, streamed or whole."""
        return await Generation(self.service, endpoint, body, req, request, make_format).reply()


def serving_of(request: Request) -> Serving:
    """The app's `Serving` (a FastAPI dependency of every route)."""
    return request.app.state.serving

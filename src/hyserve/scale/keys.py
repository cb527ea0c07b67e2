"""The routing process's render of a request's prompt: the same token ids and tenant salt a replica will
compute (the same `ModelRuntime.render_chat` and `encode`, over the tokenizer alone), so the router can
look its prefixes up among the replicas' checkpoints. A request it cannot render (invalid, an endpoint
without a prompt, a prompt longer than the context, one without a valid API key) is routed by load; the
replica then answers it as a single server would. The API key is checked first: nothing of an
unauthenticated body is parsed or tokenized. Its work is a replica's: a prompt that cannot fit is refused from its
length before tokenizing (`prompt_bound`), and the texts kept for reuse are capped in number and bytes
(`PrefixEncoder`)."""

from __future__ import annotations

import json
import threading

from ..chat import template_message
from ..models.runtime import ModelRuntime, context_length
from ..prompt.tokens import PrefixEncoder
from ..server.guards import bearer, matching_key, tenant_salt
from ..server.schemas import ChatCompletionRequest, CompletionRequest
from ..service import ServiceConfig

ROUTED_PATHS = ("/v1/chat/completions", "/v1/completions")
KEPT_TEXTS, KEPT_BYTES = 64, 64 << 20  # the texts (and their ids) kept for prefix reuse in the routing process


class PromptKeys:
    def __init__(self, config: ServiceConfig):
        from transformers import AutoConfig, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(config.model_dir, local_files_only=True)
        context = context_length(AutoConfig.from_pretrained(config.model_dir, local_files_only=True), tokenizer)
        self.config = config
        # the renderer of a loaded runtime, without weights: `render_chat` and `encode` use only these fields
        self.runtime = ModelRuntime(
            None,
            tokenizer,
            None,
            config.model_dir,
            frozenset(),
            context,
            threading.Lock(),
            special_tokens_in_content=config.allow_special_tokens_in_content,
        )
        self.runtime.prompt_encoder = PrefixEncoder(tokenizer, KEPT_TEXTS, self.runtime.escaper, KEPT_BYTES)

    def admitted(self, headers: list[tuple[bytes, bytes]]) -> tuple[bool, str | None]:
        """(whether the replica will take the request, the API key its tenant salt counts): on a server with
        keys only a configured one is taken (the replica refuses the rest with a 401, as `guards` does)."""
        if not self.config.api_keys:
            return True, None
        key = matching_key(bearer({"headers": headers}), self.config)
        return key is not None, key

    def of(self, path: str, headers: list[tuple[bytes, bytes]], body: bytes) -> tuple[str, list[int] | None]:
        """(salt, prompt token ids) of a request, or (salt, None) when there is nothing to route by."""
        if path not in ROUTED_PATHS:
            return "", None
        admitted, key = self.admitted(headers)
        if not admitted:
            return "", None
        try:
            data = json.loads(body)
            if path == "/v1/chat/completions":
                req = ChatCompletionRequest.model_validate(data)
                salt = tenant_salt(key, req.cache_salt)
                messages = [template_message(m.model_dump(exclude_none=True)) for m in req.messages]
                kwargs = dict(req.chat_template_kwargs or {})
                if req.tools:
                    kwargs["tools"] = [t.model_dump(exclude_none=True) for t in req.tools]
                return salt, self.runtime.render_chat(messages, True, salt, kwargs)
            req = CompletionRequest.model_validate(data)
            salt = tenant_salt(key, req.cache_salt)
            if isinstance(req.prompt, str):
                return salt, self.runtime.encode(req.prompt, salt)
            if len(req.prompt) >= self.runtime.max_model_len:
                return salt, None
            return salt, [int(t) for t in req.prompt]
        except Exception:  # the replica says what is wrong with it
            return "", None

"""The routing process's render of a request's prompt: the same token ids and tenant salt a replica will
compute (the same `ModelRuntime.render_chat` and `encode`, over the tokenizer alone), so the router can
look its prefixes up among the replicas' checkpoints. A request it cannot render (invalid, an endpoint
without a prompt, a prompt longer than the context) is routed by load; the replica then answers it as a single
server would. Its work is a replica's: a prompt that cannot fit is refused from its length before tokenizing
(`prompt_bound`), and the texts kept for reuse are capped in number and bytes (`PrefixEncoder`)."""

from __future__ import annotations

import json
import threading

from ..chat import template_message
from ..prompt_tokens import PrefixEncoder
from ..runtime import ModelRuntime, context_length
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
        self.runtime = ModelRuntime(None, tokenizer, None, config.model_dir, frozenset(), context, threading.Lock(),
                                    special_tokens_in_content=config.allow_special_tokens_in_content)
        self.runtime.prompt_encoder = PrefixEncoder(tokenizer, KEPT_TEXTS, self.runtime.escaper, KEPT_BYTES)

    def salt(self, headers: list[tuple[bytes, bytes]], cache_salt: str | None) -> str:
        """The tenant salt the replica will use (only a configured key counts; any other is refused there)."""
        key = matching_key(bearer({"headers": headers}), self.config) if self.config.api_keys else None
        return tenant_salt(key, cache_salt)

    def of(self, path: str, headers: list[tuple[bytes, bytes]], body: bytes) -> tuple[str, list[int] | None]:
        """(salt, prompt token ids) of a request, or (salt, None) when there is nothing to route by."""
        if path not in ROUTED_PATHS:
            return "", None
        try:
            data = json.loads(body)
            if path == "/v1/chat/completions":
                req = ChatCompletionRequest.model_validate(data)
                salt = self.salt(headers, req.cache_salt)
                messages = [template_message(m.model_dump(exclude_none=True)) for m in req.messages]
                kwargs = dict(req.chat_template_kwargs or {})
                if req.tools:
                    kwargs["tools"] = [t.model_dump(exclude_none=True) for t in req.tools]
                return salt, self.runtime.render_chat(messages, True, salt, kwargs)
            req = CompletionRequest.model_validate(data)
            salt = self.salt(headers, req.cache_salt)
            if isinstance(req.prompt, str):
                return salt, self.runtime.encode(req.prompt, salt)
            if len(req.prompt) >= self.runtime.max_model_len:
                return salt, None
            return salt, [int(t) for t in req.prompt]
        except Exception:  # the replica says what is wrong with it
            return "", None

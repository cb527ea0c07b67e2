"""What callers hand the engine and what it hands back: a request, its streamed pieces and its one final item."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ..cache.policy import Boundary
from .sampling import SamplingParams


@dataclass
class GenerationRequest:
    prompt: list[int]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: Sequence[str] = ()
    messages: list[dict] | None = None  # chat requests: lets the policy find message boundaries
    chat: ChatPrompt | None = None  # prompt and boundaries from Engine.render_chat, off the engine's thread
    cache_salt: str = ""  # tenant namespace of the prefix cache
    template_kwargs: dict | None = None  # chat: extra template arguments (tools, ...) for every render of `messages`
    # chat: reply text -> the assistant message the next request's `messages` will hold for it (reasoning and
    # tool calls parsed, `hyserve.chat.ChatTurn.history_message`); None: the text as the message's content
    reply_message: Callable[[str], dict] | None = None
    timeout: float | None = None  # seconds from arrival
    # n > 1: a sibling request with the same prompt, submitted first; this one decodes from a copy of its
    # state once it has prefilled (when it is still running then; else it restores and prefills as usual)
    prefill_from: GenerationRequest | None = None
    grammar: object | None = None  # hyserve.engine.grammar.Compiled: structured output, masks every sampled token
    # record the state after *every* generated token (prompt + output, the last token fed too) in place of the
    # usual post-decode checkpoint: /v1/responses continues a stored response from exactly there
    keep_final: bool = False
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    cancelled: threading.Event = field(default_factory=threading.Event)
    arrival: float = field(default_factory=time.perf_counter)


@dataclass
class Delta:
    text: str
    token_ids: list[int]
    logprobs: list | None = None  # one (token, logprob, [(id, logprob)...]) per token id, when requested
    cached_tokens: int = 0  # prompt tokens restored from the cache (as Finished's: /v1/messages' message_start)


@dataclass
class Finished:
    reason: str  # "stop" | "length" | "cancelled" | "timeout"
    text: str
    token_ids: list[int]
    prompt_tokens: int
    cached_tokens: int
    ttft: float | None
    logprobs: list | None = None  # as Delta.logprobs, for every generated token


@dataclass
class Failed:
    message: str
    code: str | None = None  # "shutting_down": cut off by a stopping server (the routes answer 503)


SHUTTING_DOWN = "shutting_down"


Emit = Callable[[object], None]


@dataclass
class ChatPrompt:
    """A rendered chat prompt and the checkpoint boundaries the policy found in it."""

    prompt: list[int]
    boundaries: list[Boundary]
    skipped: list[str]  # reasons a boundary was not usable (telemetry)


def expired(req: GenerationRequest, now: float) -> bool:
    return req.timeout is not None and now - req.arrival > req.timeout

"""Runs one request against the model: restore from the prefix cache, prefill with checkpoints at the
policy's boundaries, decode, record the post-decode checkpoint.

Requests run one at a time on a single worker thread holding the runtime lock; the HTTP layer talks to
it through `stream()` (async) and never touches the model.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Sequence

from .cache.manager import PrefixCache
from .cache.policy import CheckpointPolicy
from .metrics import Metrics
from .runtime import ModelRuntime
from .sampling import Sampler, SamplingParams
from .sequence import OutputSequence
from .speculative import PromptLookup, SpeculativeConfig, accepted_prefix

log = logging.getLogger("hyserve.engine")


@dataclass
class GenerationRequest:
    prompt: list[int]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: Sequence[str] = ()
    messages: list[dict] | None = None  # chat requests: lets the policy find message boundaries
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    cancelled: threading.Event = field(default_factory=threading.Event)
    arrival: float = field(default_factory=time.perf_counter)


@dataclass
class Delta:
    text: str
    token_ids: list[int]


@dataclass
class Finished:
    reason: str  # "stop" | "length" | "cancelled"
    text: str
    token_ids: list[int]
    prompt_tokens: int
    cached_tokens: int
    ttft: float | None


@dataclass
class Failed:
    message: str


Emit = Callable[[object], None]


class Engine:
    def __init__(self, runtime: ModelRuntime, cache: PrefixCache, policy: CheckpointPolicy, metrics: Metrics,
                 prefill_chunk: int = 512, speculative: SpeculativeConfig | None = None):
        self.runtime = runtime
        self.cache = cache
        self.policy = policy
        self.metrics = metrics
        self.prefill_chunk = prefill_chunk
        # Builds a proposer (extend(tokens), propose() -> ids) per request; tests may swap in their own.
        self.make_proposer = (lambda prompt: PromptLookup(speculative, prompt)) if speculative else None
        self._queue: queue.Queue = queue.Queue()
        self._worker = threading.Thread(target=self._work, name="hyserve-engine", daemon=True)
        self._worker.start()

    # -- public API ------------------------------------------------------------------------
    def generate(self, req: GenerationRequest) -> Finished:
        """Blocking: run `req` on the calling thread (benchmarks and tests without HTTP)."""
        out: list = []
        self._run(req, out.append)
        last = out[-1]
        if isinstance(last, Failed):
            raise RuntimeError(last.message)
        return last

    async def stream(self, req: GenerationRequest) -> AsyncIterator[object]:
        """Yield Delta items then one Finished (or Failed); cancels the request if the consumer goes away."""
        loop = asyncio.get_running_loop()
        items: asyncio.Queue = asyncio.Queue()
        self._queue.put((req, lambda item: loop.call_soon_threadsafe(items.put_nowait, item)))
        try:
            while True:
                item = await items.get()
                yield item
                if isinstance(item, (Finished, Failed)):
                    return
        finally:
            req.cancelled.set()

    # -- worker ----------------------------------------------------------------------------
    def _work(self) -> None:
        while True:
            req, emit = self._queue.get()
            if req.cancelled.is_set():
                emit(Finished("cancelled", "", [], len(req.prompt), 0, None))
                continue
            self._run(req, emit)

    def _run(self, req: GenerationRequest, emit: Emit) -> None:
        rt = self.runtime
        boundaries, skipped = self.policy.prefill_boundaries(
            req.prompt, req.messages, rt.render_chat, rt.has_recurrent_layers
        ) if self.cache.enabled else ([], [])
        for reason in skipped:
            self.cache.telemetry.emit("skipped", reason, request_id=req.request_id)
        with rt.lock:
            self.metrics.running.inc()
            restored = self.cache.restore(rt.adapter, req.prompt, req.request_id)
            try:
                self._generate(req, restored, boundaries, emit)
            except Exception as exc:  # never leave the client hanging; the cache only holds verified snapshots
                log.exception("request %s failed", req.request_id)
                emit(Failed(f"generation failed: {type(exc).__name__}: {exc}"))
            finally:
                self.cache.release(restored)
                self.metrics.running.dec()

    def _speculate(self, state, token: int, proposals: list[int], out: OutputSequence, lookup):
        """Verify `proposals` after `token` in one pass; push the accepted ones through `out` like any
        decoded token; leave `state` at exactly prompt + generated[:-1]. Returns (next logits, finish)."""
        adapter = self.runtime.adapter
        t0 = time.perf_counter()
        point = adapter.rollback_point(state)
        all_logits = adapter.forward(state, [token] + proposals, all_logits=True)
        accepted = accepted_prefix(all_logits, proposals)
        keep, reason = accepted + 1, None  # tokens of [token] + proposals the state should hold
        for i, d in enumerate(proposals[:accepted]):
            reason = out.push(d)
            lookup.extend([d])
            if reason is not None:
                keep = i + 1
                break
        logits = all_logits[keep - 1]
        if keep < len(proposals) + 1:
            rerun = adapter.rewind(state, point, ([token] + proposals)[:keep])
            if rerun is not None:
                logits = rerun
        self.metrics.spec_proposed.inc(len(proposals))
        self.metrics.spec_accepted.inc(keep - 1 if reason else accepted)
        self.metrics.spec_seconds.observe(time.perf_counter() - t0)
        return logits, reason

    def _prefill_to(self, state, prompt: Sequence[int], end: int):
        logits = None
        while state.position < end:
            stop = min(end, state.position + self.prefill_chunk)
            logits = self.runtime.adapter.forward(state, prompt[state.position : stop])
        return logits

    def _generate(self, req: GenerationRequest, restored, boundaries, emit: Emit) -> None:
        rt, adapter, state = self.runtime, self.runtime.adapter, restored.state
        prompt = req.prompt
        for b in boundaries:
            if b.length <= state.position or self.cache.has(prompt[: b.length]):
                why = "behind_restored_state" if b.length <= state.position else "already_cached"
                self.cache.telemetry.emit("skipped", why, request_id=req.request_id, kind=b.kind, tokens=b.length)
                continue
            self._prefill_to(state, prompt, b.length)
            self.cache.record(adapter, state, b.kind, b.length, req.request_id)
        computed = len(prompt) - state.position
        logits = self._prefill_to(state, prompt, len(prompt))
        self.metrics.prompt_tokens.inc(len(prompt))
        self.metrics.prefill_tokens.inc(computed)

        sampler = Sampler(req.sampling)
        out = OutputSequence(rt.tokenizer, rt.eos_token_ids, req.stop, req.max_tokens, req.arrival, self.metrics,
                             lambda text, ids: emit(Delta(text, list(ids))))
        # Speculation is exact only for greedy decoding (no rejection sampling): off otherwise.
        lookup = self.make_proposer(prompt) if self.make_proposer and req.sampling.greedy else None
        reason = None
        while reason is None:
            if req.cancelled.is_set():
                reason = "cancelled"
                break
            token = sampler(logits)
            reason = out.push(token)
            if reason is not None:
                break
            proposals = []
            if lookup is not None:
                lookup.extend([token])
                proposals = lookup.propose()[: req.max_tokens - len(out.generated)]
            if not proposals:
                logits = adapter.forward(state, [token])
                continue
            logits, reason = self._speculate(state, token, proposals, out, lookup)
        text = out.close(reason)
        generated = out.generated
        if reason == "cancelled":
            self.cache.telemetry.emit("declined", "cancelled", request_id=req.request_id, kind="post_decode")
        else:
            ok, why = self.policy.post_decode_ok(state.tokens, req.messages, text, rt.render_chat,
                                                 rt.has_recurrent_layers)
            if why == "rerender_mismatch" and self.cache.enabled:
                self.metrics.rerender_mismatch.inc()
            if ok:
                self.cache.record(adapter, state, "post_decode", len(prompt) + len(generated) - 1, req.request_id)
            elif self.cache.enabled:
                self.cache.telemetry.emit("declined", why, request_id=req.request_id, kind="post_decode",
                                          tokens=state.position)
        emit(Finished(reason, text, generated, len(prompt), restored.cached_tokens, out.ttft))

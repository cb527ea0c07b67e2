"""Admission: from the waiting queue to a running request with a plan and a live state.

A step first drops waiting requests that were cancelled or timed out, admits the rest into free running
slots, and plans each new one outside the runtime lock (its checkpoint boundaries, sampler, proposer);
under the lock it then restores each one's live state from the prefix cache.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from ..cache.manager import PrefixCache, Restored
from ..cache.policy import Boundary, CheckpointPolicy
from ..metrics import Metrics
from ..models.runtime import ModelRuntime
from ..prompt import next_turn
from . import logits
from .api import Delta, Finished, GenerationRequest, expired
from .phase import Phase
from .run import Run
from .sampling import Sampler
from .scheduler import Scheduler
from .sequence import OutputSequence


class Admission(Phase):
    def __init__(
        self,
        runtime: ModelRuntime,
        cache: PrefixCache,
        policy: CheckpointPolicy,
        metrics: Metrics,
        scheduler: Scheduler,
    ):
        super().__init__(runtime, cache, policy, metrics, scheduler)
        # Builds a proposer (extend(tokens), propose() -> ids) per request, or None: no speculation.
        self.make_proposer = None
        # Builds a request's sampler (logits -> token id) from its SamplingParams (a hook: hyserve.testing.forced
        # forces scripted replies through it).
        self.make_sampler: Callable = Sampler

    # -- rendering: the policy's checkpoint boundaries in a chat prompt ----------------------------------
    def render(
        self, messages: list[dict], prompt: list[int] | None, salt: str = "", template_kwargs: dict | None = None
    ):
        """The prompt (unless given) and the policy's boundaries in it; `salt`: the tenant's namespace;
        `template_kwargs`: the request's extra template arguments (tools, ...), the same for every render."""
        rt = self.runtime
        wanted = self.policy.wanted_renders(messages, rt.has_recurrent_layers) if self.cache.enabled else []
        plain = [(kind, m) for kind, m in wanted if kind != "system"]
        items = ([] if prompt is not None else [(messages, True)]) + [(m, False) for _, m in plain]
        rendered = rt.render_many(items, salt, template_kwargs) if items else []
        if prompt is None:
            prompt = rendered.pop(0)
            if isinstance(prompt, Exception):
                raise prompt
        for kind, m in wanted:  # the system prompt as every chat that opens with it renders it (a user follows)
            if kind == "system":
                rendered.insert(0, self._system_prefix(m, salt, template_kwargs))
        boundaries, skipped = self.policy.boundaries_from(
            prompt, [w for w in wanted if w[0] == "system"] + plain, rendered
        )
        return prompt, boundaries, skipped

    def _system_prefix(self, messages: list[dict], salt: str, template_kwargs: dict | None) -> list[int] | Exception:
        rt = self.runtime
        try:
            return next_turn.prefix_before(
                messages, {"role": "user"}, lambda items: rt.render_many(items, salt, template_kwargs), rt.special_ids
            )
        except Exception as exc:  # the policy skips it, with the reason
            return exc

    def boundaries(self, req: GenerationRequest) -> tuple[list[Boundary], list[str]]:
        """The policy's checkpoint boundaries in `req.prompt`, and why any were skipped; never raises."""
        try:
            _, boundaries, skipped = self.render(req.messages, req.prompt, req.cache_salt, req.template_kwargs)
        except Exception as exc:
            boundaries, skipped = [], [f"policy_failed:{type(exc).__name__}"]
        return boundaries, skipped

    # -- the phase ---------------------------------------------------------------------------------------
    def drop_abandoned(self) -> None:
        """Waiting requests cancelled or timed out before they started: finished without running."""
        now = time.perf_counter()
        for run in self.scheduler.take_waiting(lambda r: r.req.cancelled.is_set() or expired(r.req, now)):
            reason = "cancelled" if run.req.cancelled.is_set() else "timeout"
            run.end(Finished(reason, "", [], len(run.req.prompt), 0, None))

    def admit(self, guard: Callable) -> list[Run]:
        """Move waiting requests into free running slots and plan each one (outside the runtime lock: renders
        for checkpoint boundaries). Every running request without a plan gets one here, each in its own
        `guard`, so one that cannot be planned (a seed the sampler refuses) fails alone and leaves the running
        list. Returns the newly admitted requests."""
        new = self.scheduler.admit()
        self.metrics.waiting.set(len(self.scheduler.waiting))
        for run in [r for r in self.scheduler.running if r.out is None]:
            guard([run], self.plan, run)
        return new

    def plan(self, run: Run) -> None:
        req, rt = run.req, self.runtime
        if self.cache.enabled:
            if req.chat is not None and req.chat.prompt == req.prompt:
                run.boundaries, skipped = list(req.chat.boundaries), list(req.chat.skipped)
            else:  # a `submit` caller that did not render them
                run.boundaries, skipped = self.boundaries(req)
            for reason in skipped:
                self.cache.telemetry.emit("skipped", reason, request_id=req.request_id)
        run.sampler = self.make_sampler(req.sampling)
        run.constraint = req.grammar.start() if req.grammar is not None else None
        run.pipeline = logits.build(req.sampling, req.prompt, rt.eos_token_ids)
        ending = rt.eos_token_ids | frozenset(req.sampling.stop_token_ids)

        def emit(text: str, ids, lps) -> None:
            cached = run.restored.cached_tokens if run.restored is not None else 0
            run.emit(Delta(text, list(ids), lps, cached))

        run.out = OutputSequence(rt.tokenizer, ending, req.stop, req.max_tokens, req.arrival, self.metrics, emit)
        # Speculation is exact only for greedy decoding (no rejection sampling) on the raw logits (its verify
        # pass applies no processors and computes no logprobs, though it masks with the grammar): off otherwise.
        if self.make_proposer and req.sampling.greedy and not run.pipeline and req.sampling.logprobs is None:
            run.proposer = self.make_proposer(req.prompt)

    def restore_all(self, guard: Callable, waits: Callable[[Run], bool] = lambda run: False) -> None:
        """Under the runtime lock: a live state for every running request without one, each in its own
        `guard`. One cancelled since it was admitted gets none (it finishes without running), nor one
        waiting to copy a sibling's prefilled state (`fork_all`), nor one that `waits` for a job building
        its history (`Background.blocks`)."""
        for run in [
            r
            for r in self.scheduler.running
            if r.restored is None and r.out is not None and not r.req.cancelled.is_set() and not waits(r)
        ]:
            leader = self.leader(run)
            if leader is None or leader.decoding:
                guard([run], self.restore, run)

    def leader(self, run: Run) -> Run | None:
        """The running sibling whose prefilled state `run` is to copy (n > 1), if there is one."""
        want = run.req.prefill_from
        if want is None:
            return None
        return next((r for r in self.scheduler.running if r.req is want and not r.ended), None)

    def fork_all(self, guard: Callable) -> None:
        """Under the lock, between prefill and decode: each request waiting on a sibling that has just
        prefilled (no token sampled yet) starts from a copy of its state and logits: n choices, one prefill."""
        for run in [
            r
            for r in self.scheduler.running
            if r.restored is None and r.out is not None and not r.req.cancelled.is_set()
        ]:
            leader = self.leader(run)
            if leader is not None and leader.decoding and not leader.out.generated:
                guard([run], self.fork, run, leader)

    def fork(self, run: Run, leader: Run) -> None:
        adapter, state = self.runtime.adapter, leader.state
        copy = adapter.restore(adapter.snapshot(state), list(state.tokens))
        run.restored = Restored(copy, leader.restored.cached_tokens, None)
        run.checkpoint, run.boundaries, run.deferred = leader.checkpoint, [], []  # the leader records them
        run.logits = leader.logits
        self.metrics.running.inc()

    def restore(self, run: Run) -> None:
        """The run's live state, from its deepest cached checkpoint."""
        req = run.req
        run.restored = self.cache.restore(self.runtime.adapter, req.prompt, req.request_id, req.cache_salt)
        run.checkpoint = run.restored.cached_tokens
        self.metrics.running.inc()

"""Prefill: advance requests through their prompts, taking checkpoints at the policy's boundaries.

Each step runs one chunk of the oldest request in prefill, then, while the step's budget of `prefill_chunk`
tokens lasts, further pieces (up to the next boundary or the prompt's end) that fit whole. Short prompts
then share a step and join the decode batch sooner (a fuller batch makes more tokens per pass), while a
step, and so every stream's inter-token gap, stays about as long as one chunk: each piece is also charged
PIECE_COST tokens for its fixed costs (a forward pass, snapshots).

Boundaries are taken from inside the pass where the adapter can capture the state there (Gated DeltaNet
models), else the prompt is split at them; those the policy finds cheaper to build later are deferred to
a background job.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from ..cache.manager import PrefixCache
from ..cache.policy import Boundary, CheckpointPolicy
from ..metrics import Metrics
from ..models.runtime import ModelRuntime
from .phase import Phase
from .run import Run
from .scheduler import Scheduler

log = logging.getLogger("hyserve.engine")

# What one more prefill piece in a step costs beyond its tokens, in tokens: its forward pass's fixed cost
# (about a decode step) and a checkpoint snapshot take together about as long as prefilling a few dozen
# tokens of the bench model (docs/design.md, "Figures behind some constants").
PIECE_COST = 64


class Prefill(Phase):
    def __init__(
        self,
        runtime: ModelRuntime,
        cache: PrefixCache,
        policy: CheckpointPolicy,
        metrics: Metrics,
        scheduler: Scheduler,
        prefill_chunk: int,
    ):
        super().__init__(runtime, cache, policy, metrics, scheduler)
        self.prefill_chunk = prefill_chunk

    def run(self, runs: list[Run], guard: Callable) -> None:
        """One step's budget of prefill over `runs` (those not yet decoding, oldest first). `guard(runs, fn,
        *args)` calls `fn` and fails `runs` if it raises (returning None)."""
        budget, fit = self.prefill_chunk, None
        for run in runs:
            while budget > 0 and not run.decoding:  # a failed piece (ran None) ends the loop
                ran = guard([run], self.chunk, run, fit)
                if not ran:
                    break
                budget -= ran + PIECE_COST
                fit = budget
            if budget <= 0:
                break

    def chunk(self, run: Run, fit: int | None = None) -> int:
        """Advance one chunk and snapshot every checkpoint boundary it reaches: boundaries inside the piece
        from states captured in its pass, or, where the adapter cannot capture, a piece never runs past the
        next boundary. With `fit`, run the piece only if it has at most `fit` tokens. Returns the number of
        tokens run."""
        req, state, adapter = run.req, run.state, self.runtime.adapter
        prompt = req.prompt
        while run.boundaries and (
            run.boundaries[0].length <= state.position
            or self.cache.has(prompt[: run.boundaries[0].length], req.cache_salt)
        ):
            b = run.boundaries.pop(0)
            why = "behind_restored_state" if b.length <= state.position else "already_cached"
            if why == "already_cached":
                run.checkpoint = b.length
            self.cache.telemetry.emit("skipped", why, request_id=req.request_id, kind=b.kind, tokens=b.length)
        busy = len(self.scheduler.running) > 1 or bool(self.scheduler.waiting)
        captures = bool(run.boundaries) and adapter.can_capture()
        end = min(len(prompt), state.position + self.prefill_chunk)
        while True:  # the boundaries this piece reaches: the first one, or with capture all up to its end
            due = [b for b in run.boundaries if b.length <= end] if captures else run.boundaries[:1]
            late = next((b for b in due if not self.policy.split_now(b, run.checkpoint, len(prompt), busy)), None)
            if late is None:
                break
            run.boundaries.remove(late)
            run.deferred.append(late)
            self.cache.telemetry.emit(
                "deferred",
                "short_tail",
                request_id=req.request_id,
                kind=late.kind,
                tokens=late.length,
                from_tokens=run.checkpoint,
            )
        if run.boundaries and not captures:
            end = min(end, run.boundaries[0].length)
        start = state.position
        if fit is not None and end - start > fit:
            return 0
        inside = [b for b in run.boundaries if b.length < end] if captures else []
        if inside:
            logits, states = adapter.forward_capturing(state, prompt[start:end], [b.length - start for b in inside])
            for i, b in enumerate(inside):
                run.boundaries.remove(b)
                self.record(run, b, states[i] if states else None)
        else:
            logits = adapter.forward(state, prompt[start:end])
        self.metrics.prefill_tokens.inc(end - start)
        log.debug(
            "prefill %s: tokens %d-%d of %d (%d from the cache)",
            req.request_id,
            start,
            end,
            len(prompt),
            run.restored.cached_tokens,
        )
        if run.boundaries and run.boundaries[0].length == state.position:
            self.record(run, run.boundaries.pop(0), state)
        if state.position == len(prompt):
            self.metrics.prompt_tokens.inc(len(prompt))
            run.logits = logits
        return end - start

    def record(self, run: Run, b: Boundary, state) -> None:
        """Checkpoint `b` from `state` (the live state, or one captured inside the piece; None: not had)."""
        req = run.req
        if state is None:
            self.cache.telemetry.emit(
                "declined", "capture_failed", request_id=req.request_id, kind=b.kind, tokens=b.length
            )
        elif self.cache.record(self.runtime.adapter, state, b.kind, b.length, req.request_id, req.cache_salt):
            run.snapshots += 1
            run.checkpoint = b.length

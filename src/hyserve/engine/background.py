"""Jobs: the re-rendered history of a reply that does not re-tokenize as generated (and checkpoints a policy
with deferral left for later), built right after the reply is sent.

Agents send the next request the instant a reply arrives, so this work cannot wait for idle time. A job
starts as soon as its reply is out and keeps its live state until it is done: the engine builds it while
no request runs, and when a request comes in, the job pauses there (nothing computed is thrown away) unless
that request extends it. A request whose prompt extends a job (its own conversation's next turn) waits for
the job, which then runs one chunk per step, and restores the whole history from its checkpoint: the work
the job had done before the request arrived is not done twice, and what was left is done once.
"""

from __future__ import annotations

import logging

from ..cache.manager import PrefixCache, Restored
from ..cache.policy import Boundary, CheckpointPolicy
from ..metrics import Metrics
from ..models.runtime import ModelRuntime
from .phase import Phase
from .run import Job, Run
from .scheduler import Scheduler

log = logging.getLogger("hyserve.engine")

# Tokens per piece of work nobody waits for: a request that arrives meanwhile waits for at most one piece,
# and a full prefill chunk at a real size takes well over a second on a CPU (docs/benchmarks.md, bench_real.py).
PIECE = 128


class Background(Phase):
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
        self.chunk = prefill_chunk
        self.piece = min(prefill_chunk, PIECE)
        self.active: Job | None = None  # the job being built, with its live state in `restored`
        self.restored: Restored | None = None

    # -- queueing -------------------------------------------------------------------------------------
    def queue_for(self, run: Run, rebuilds: list[list[int]]) -> None:
        """Jobs for the checkpoints a finished request deferred and for its re-rendered histories (one per
        habit of the client the engine could not tell apart): one job where a re-rendered history extends
        the deferred boundaries, else one each."""
        req, stops = run.req, list(run.deferred)
        tokens = list(req.prompt[: stops[-1].length]) if stops else []
        for rebuild in rebuilds:
            if not rebuild or self.cache.has(rebuild, req.cache_salt):
                continue
            extends = bool(stops) and list(rebuild[: len(tokens)]) == tokens  # one job takes the deferred stops
            self.scheduler.add_background(
                Job(
                    list(rebuild),
                    (stops if extends else []) + [Boundary(len(rebuild), "reply_rerender")],
                    req.cache_salt,
                    req.request_id,
                )
            )
            if extends:
                stops = []
        if stops:
            self.scheduler.add_background(Job(tokens, stops, req.cache_salt, req.request_id))

    def pending(self) -> bool:
        return self.active is not None or bool(self.scheduler.background)

    def blocks(self, run: Run) -> bool:
        """Whether `run` waits for a job: its prompt extends the job's tokens (it needs that history)."""
        req = run.req
        jobs = ([self.active] if self.active is not None else []) + list(self.scheduler.background)
        return any(j.extended_by(req.prompt, req.cache_salt) for j in jobs)

    # -- building -------------------------------------------------------------------------------------
    def idle(self, stopping=lambda: False) -> None:
        """No request waits or runs: build jobs, newest first, one piece per lock hold, until none is left, a
        request arrives (the job then pauses with its state; the next step sees whether the request needs
        it) or the engine is `stopping`."""
        while not self.scheduler.busy and not stopping():
            with self.runtime.lock:
                if not self._select(lambda job: True):
                    return
                self._piece(self.piece)

    def for_waiting(self, waiting: list[Run]) -> None:
        """Under the lock: one chunk of the job that the oldest of `waiting` (requests that extend a job)
        needs; the active job first if it is that one, else it pauses (recorded where it stands)."""
        for run in waiting:
            if self._select(lambda job: job.extended_by(run.req.prompt, run.req.cache_salt)):  # noqa: B023 (called at once)
                self._piece(self.chunk)
                return

    def _select(self, wanted) -> bool:
        """Under the lock: make a job that `wanted` accepts the active one (pausing another, starting the
        newest such job). False when there is none left."""
        while True:
            if self.active is not None and wanted(self.active):
                return True
            job = next((j for j in reversed(self.scheduler.background) if wanted(j)), None)
            if job is None:
                return False
            self._pause()
            self.scheduler.take_background(lambda j: j is job)  # noqa: B023 (called at once)
            self._start(job)

    def _start(self, job: Job) -> None:
        rid = job.request_id
        try:
            restored = self.cache.restore(self.runtime.adapter, job.tokens, rid, job.salt, count=False, keep_last=False)
        except Exception:  # (restores fail closed; a job is only an optimization)
            log.exception("background job for %s: restore failed", rid)
            return
        if len(job.tokens) - restored.state.position > self.policy.max_rebuild_tokens:
            self.cache.telemetry.emit(
                "declined",
                "rebuild_too_long",
                request_id=rid,
                kind=",".join(b.kind for b in job.stops),
                tokens=len(job.tokens),
            )
            self.cache.release(restored)
            return
        job.stops = [b for b in job.stops if b.length > restored.state.position]
        self.active, self.restored = job, restored
        if not job.stops:
            self._finish()

    def _pause(self) -> None:
        """Put the active job back in the queue, its state recorded where it stands so no work is lost."""
        job = self.active
        if job is None:
            return
        state = self.restored.state
        if state.position > self.restored.cached_tokens:
            self.cache.record(self.runtime.adapter, state, "rebuild_partial", state.position, job.request_id, job.salt)
        self.cache.telemetry.emit(
            "deferred", "paused", request_id=job.request_id, tokens=len(job.tokens), from_tokens=state.position
        )
        self.scheduler.add_background(job)
        self._finish()

    def _piece(self, tokens: int) -> None:
        """Under the lock: advance the active job by up to `tokens`, recording each stop it reaches."""
        job, rt = self.active, self.runtime
        if job is None:
            return
        state = self.restored.state
        try:
            end = min(job.stops[-1].length, state.position + tokens)
            while state.position < end:
                stop = min(end, job.stops[0].length)
                rt.adapter.forward(state, job.tokens[state.position : stop])
                if stop == job.stops[0].length:
                    b = job.stops.pop(0)
                    self.cache.record(rt.adapter, state, b.kind, b.length, job.request_id, job.salt)
        except Exception:  # a job is an optimization: its failure costs its conversation a cache hit, no more
            log.exception("background job for %s failed", job.request_id)
            job.stops = []
        if not job.stops:
            self._finish()

    def _finish(self) -> None:
        restored, self.active, self.restored = self.restored, None, None
        if restored is not None:
            self.cache.release(restored)

    def cancel(self, pred) -> list[Job]:
        """Drop the jobs `pred` accepts, the one being built included, with what it has not recorded yet (a
        clear of their tenant's cache: `Engine.clear_cache`, under the runtime lock). Returns them."""
        dropped = self.scheduler.take_background(pred)
        if self.active is not None and pred(self.active):
            dropped.append(self.active)
            self._finish()
        return dropped

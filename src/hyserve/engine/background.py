"""Background jobs: checkpoints that are cheaper to build later than to split a prefill for (the policy
says which), and the re-rendered history of a reply that does not re-tokenize.

A job runs when no request is waiting or running, from the deepest checkpoint, and gives way to real
requests; a new request whose prompt extends a pending job takes the job's checkpoints over as its own
boundaries (see `Admission.plan`), so that work is done once, inside the prefill that needs those tokens
anyway.
"""

from __future__ import annotations

from ..cache.manager import PrefixCache
from ..cache.policy import Boundary, CheckpointPolicy
from ..metrics import Metrics
from ..runtime import ModelRuntime
from ..scheduler import Scheduler
from .phase import Phase
from .run import Job, Run


# Tokens per piece of idle-time work: a request that arrives meanwhile waits for at most one piece (at 0.75B
# parameters on 2 CPU cores a 512-token piece took over a second and a half).
PIECE = 128


class Background(Phase):
    def __init__(self, runtime: ModelRuntime, cache: PrefixCache, policy: CheckpointPolicy, metrics: Metrics,
                 scheduler: Scheduler, prefill_chunk: int):
        super().__init__(runtime, cache, policy, metrics, scheduler)
        self.piece = min(prefill_chunk, PIECE)

    def queue_for(self, run: Run, rebuild: list[int] | None) -> None:
        """Jobs for the checkpoints a finished request deferred and for a re-rendered reply: one job when
        the re-rendered history extends the deferred boundaries (it usually does), else two."""
        req, stops = run.req, list(run.deferred)
        tokens = list(req.prompt[: stops[-1].length]) if stops else []
        if rebuild and not self.cache.has(rebuild, req.cache_salt):
            if stops and list(rebuild[: len(tokens)]) != tokens:
                self.scheduler.add_background(Job(tokens, stops, req.cache_salt, req.request_id))
                stops = []
            tokens, stops = list(rebuild), stops + [Boundary(len(rebuild), "reply_rerender")]
        if stops:
            self.scheduler.add_background(Job(tokens, stops, req.cache_salt, req.request_id))

    def run(self, job: Job) -> None:
        """Idle time: build `job.tokens` from their deepest checkpoint, one piece per lock hold, recording
        every stop on the way; as soon as real requests arrive, put what is left back in the queue."""
        rt, tokens, rid = self.runtime, job.tokens, job.request_id
        with rt.lock:
            restored = self.cache.restore(rt.adapter, tokens, rid, job.salt, count=False, keep_last=False)
        try:
            state = restored.state
            stops = [b for b in job.stops if b.length > state.position]
            kinds = ",".join(b.kind for b in stops)
            if len(tokens) - state.position > self.policy.max_rebuild_tokens:
                self.cache.telemetry.emit("declined", "rebuild_too_long", request_id=rid, kind=kinds,
                                          tokens=len(tokens))
                return
            while stops:
                if self.scheduler.busy:  # back in the queue: a new request that extends it takes it over
                    self.cache.telemetry.emit("deferred", "preempted", request_id=rid, kind=kinds,
                                              tokens=len(tokens))
                    self.scheduler.add_background(Job(tokens, stops, job.salt, rid))
                    return
                with rt.lock:
                    end = min(stops[0].length, state.position + self.piece)
                    rt.adapter.forward(state, tokens[state.position : end])
                    if end == stops[0].length:
                        b = stops.pop(0)
                        self.cache.record(rt.adapter, state, b.kind, b.length, rid, job.salt)
        finally:
            with rt.lock:
                self.cache.release(restored)

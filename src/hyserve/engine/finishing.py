"""Finishing: a request leaves the running list, with its final item, its post-decode checkpoint (when the
policy says the next turn will start from it) and idle-time jobs for what it deferred. Its live state and
its pin on the cache go at once, so the slot is free for the next step."""

from __future__ import annotations

from ..cache.manager import PrefixCache
from ..cache.policy import CheckpointPolicy
from ..metrics import Metrics
from ..runtime import ModelRuntime
from ..scheduler import Scheduler
from .api import Finished
from .background import Background
from .run import Run


class Finishing:
    def __init__(self, runtime: ModelRuntime, cache: PrefixCache, policy: CheckpointPolicy, metrics: Metrics,
                 scheduler: Scheduler, background: Background):
        self.runtime = runtime
        self.cache = cache
        self.policy = policy
        self.metrics = metrics
        self.scheduler = scheduler
        self.background = background

    def finish(self, run: Run, reason: str) -> None:
        req, rt, state = run.req, self.runtime, run.state
        text = run.out.close(reason)
        generated = run.out.generated
        rebuild = None
        if reason in ("cancelled", "timeout") or not run.decoding:
            self.cache.telemetry.emit("declined", reason, request_id=req.request_id, kind="post_decode")
        else:
            ok, why, rebuild = self.policy.post_decode_ok(state.tokens, req.messages, text, rt.render_chat,
                                                          rt.has_recurrent_layers)
            if why == "rerender_mismatch" and self.cache.enabled:
                self.metrics.rerender_mismatch.inc()
            if ok:
                run.snapshots += self.cache.record(rt.adapter, state, "post_decode",
                                                   len(req.prompt) + len(generated) - 1, req.request_id,
                                                   req.cache_salt)
            elif self.cache.enabled:
                self.cache.telemetry.emit("declined", why, request_id=req.request_id, kind="post_decode",
                                          tokens=state.position)
        if self.cache.enabled:
            self.background.queue_for(run, rebuild)
        cached = run.restored.cached_tokens
        self.metrics.snapshots_per_request.observe(run.snapshots)
        self.release(run)
        run.emit(Finished(reason, text, generated, len(req.prompt), cached, run.out.ttft))

    def release(self, run: Run) -> None:
        """Free the live state and unpin its checkpoint: the slot is free for the next step."""
        self.scheduler.remove(run)
        if run.restored is not None:
            self.cache.release(run.restored)
            run.restored = None
            self.metrics.running.dec()
        if not self.scheduler.running:
            self.runtime.adapter.drop_batch()

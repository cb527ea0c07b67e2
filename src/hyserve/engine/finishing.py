"""Finishing: a request leaves the running list, with its final item, its post-decode checkpoint (when the
policy says the next turn will start from it) and jobs that build its history as the next turn will send it. Its live
state and its pin on the cache go in the same step, so the slot is free for the next one.

Replies go out first: `finish` emits the final item and `settle` (before the step's next forward pass, and
at the end of the step) delivers every reply of the step in one flush, then copies their checkpoints (fresh
pages, tens of milliseconds each at real sizes) and frees their states. Requests finishing together do
not wait for each other's copies, and a next turn still finds its checkpoint: it is admitted by a later
step of the same thread.

A request also leaves when it is cancelled or times out (`reap`), and when any phase's work on it raises
(`guard`): it fails alone with a `Failed` item, and the cache only ever holds verified snapshots.
"""

from __future__ import annotations

import functools
import logging
import time

from ..cache.manager import PrefixCache
from ..cache.policy import CheckpointPolicy
from ..chat.messages import reasoning_of, sends_reasoning, without_reasoning
from ..metrics import Metrics
from ..models.runtime import ModelRuntime
from .api import Failed, Finished, expired
from .background import Background
from .outbox import Outbox
from .phase import Phase
from .run import Run
from .scheduler import Scheduler

log = logging.getLogger("hyserve.engine")

# At most this many tokens between a finished reply's state and its next turn's history (the last generated
# token, the end-of-turn tokens) are run before the checkpoint is taken, so the next turn reuses all of it.
END_OF_TURN = 32


class Finishing(Phase):
    def __init__(
        self,
        runtime: ModelRuntime,
        cache: PrefixCache,
        policy: CheckpointPolicy,
        metrics: Metrics,
        scheduler: Scheduler,
        background: Background,
        outbox: Outbox,
    ):
        super().__init__(runtime, cache, policy, metrics, scheduler)
        self.background = background
        self.outbox = outbox
        self.ending: list[tuple[Run, str, str]] = []  # finished this step, checkpoints not yet recorded

    def reap(self) -> None:
        """Finish the running requests that were cancelled or timed out (their slots free for this step)."""
        now = time.perf_counter()
        for run in list(self.scheduler.running):
            if run.req.cancelled.is_set():
                self.guard([run], self.finish, run, "cancelled")
            elif expired(run.req, now):
                self.guard([run], self.finish, run, "timeout")
        self.settle()

    def finish(self, run: Run, reason: str) -> None:
        """Emit the request's final item; `settle` records its checkpoint and frees its state. Until then its
        state must not take part in any forward pass (it has left the decode batch: it samples no token)."""
        req = run.req
        text = run.out.close(reason)
        cached = run.restored.cached_tokens if run.restored is not None else 0
        run.end(Finished(reason, text, run.out.generated, len(req.prompt), cached, run.out.ttft, run.out.logprobs))
        self.ending.append((run, reason, text))

    def settle(self) -> None:
        """Deliver the replies `finish` emitted, then, request by request, record the post-decode checkpoint,
        queue idle-time jobs and free the state. A failure costs that request's next turn its cache hit."""
        self.outbox.flush()
        ending, self.ending = self.ending, []
        for run, reason, text in ending:
            if run.released.is_set():  # failed since (a step that kept raising): nothing left to record
                continue
            try:
                rebuilds = []
                try:
                    rebuilds = self.record_post_decode(run, reason, text)
                except Exception:  # the reply is out: the next turn just misses this checkpoint
                    log.exception("request %s: recording its post-decode checkpoint failed", run.req.request_id)
                if self.cache.enabled and run.req.request_id not in self.cache.stale:  # (a clear's: not kept)
                    self.background.queue_for(run, rebuilds)
                self.metrics.snapshots_per_request.observe(run.snapshots)
            finally:
                self.guard([run], self.release, run)

    def record_post_decode(self, run: Run, reason: str, text: str) -> list[list[int]]:
        """The finished request's post-decode checkpoint, where the policy says its next turn starts from it.
        Returns the tokens of each re-rendered history to build right after the reply (a job each).

        A reply with reasoning is sent back by some clients and dropped by others (openai-agents', LangChain's
        defaults), and templates render the two differently; each conversation's earlier turns show which
        habit its client has (`sends_reasoning`): unknown, both next turns are prepared."""
        req, rt, generated = run.req, self.runtime, run.out.generated
        if reason in ("cancelled", "timeout") or not run.decoding:  # (a request cancelled before it had a state)
            self.cache.telemetry.emit("declined", reason, request_id=req.request_id, kind="post_decode")
            return []
        if req.keep_final:
            if self.cache.enabled and self.policy.post_decode:
                self.record_final(run)
            return []
        state = run.state
        render_next = functools.partial(rt.render_next_turn, salt=req.cache_salt, template_kwargs=req.template_kwargs)
        reply = req.reply_message(text) if req.reply_message else {"role": "assistant", "content": text}
        replies = [reply]
        if reasoning_of(reply) and not sends_reasoning(req.messages or []):
            replies.append(without_reasoning(reply))
        keep, rebuilds, whys, history = False, [], [], None
        for r in replies:
            ok, why, ids = self.policy.post_decode_ok(
                state.tokens, req.messages, r, render_next, rt.has_recurrent_layers
            )
            keep, whys = keep or ok, whys + [why]
            if why == "rerender_match":
                history = history or ids
            elif ids is not None and ids not in rebuilds:
                rebuilds.append(ids)
        if any(w.startswith("rerender_mismatch") for w in whys) and self.cache.enabled:
            self.metrics.rerender_mismatch.inc()
        if keep and self.cache.enabled and history is not None and 0 < len(history) - state.position <= END_OF_TURN:
            # the reply's last token and the end of its turn: the whole history, for a few tokens' pass
            rt.adapter.forward(state, history[state.position :])
            run.snapshots += self.cache.record(
                rt.adapter, state, "post_decode", len(history), req.request_id, req.cache_salt
            )
        elif keep:
            run.snapshots += self.cache.record(
                rt.adapter, state, "post_decode", len(req.prompt) + len(generated) - 1, req.request_id, req.cache_salt
            )
        elif self.cache.enabled:
            self.cache.telemetry.emit(
                "declined", ",".join(whys), request_id=req.request_id, kind="post_decode", tokens=state.position
            )
        return rebuilds

    def record_final(self, run: Run) -> None:
        """Feed the last generated token (the state holds prompt + generated[:-1]) and record the state of
        prompt + every generated token."""
        req, rt, generated = run.req, self.runtime, run.out.generated
        rt.adapter.forward(run.state, [generated[-1]])
        run.snapshots += self.cache.record(
            rt.adapter, run.state, "post_decode", len(req.prompt) + len(generated), req.request_id, req.cache_salt
        )

    def guard(self, runs: list[Run], fn, *args):
        """`fn(*args)`, or None after failing `runs` if it raised: each one leaves with a `Failed` item (unless
        it already ended) and nothing else is touched. Never raises."""
        try:
            return fn(*args)
        except Exception as exc:  # never leave a client hanging; the cache only holds verified snapshots
            log.exception("request(s) %s failed", [r.req.request_id for r in runs])
            for run in runs:
                self.fail(run, f"generation failed: {type(exc).__name__}: {exc}")
            return None

    def fail(self, run: Run, message: str) -> None:
        try:
            self.release(run)
        except Exception:  # the run has left the running list and dropped its state all the same
            log.exception("request %s: releasing its state failed", run.req.request_id)
        run.end(Failed(message))

    def release(self, run: Run) -> None:
        """Free the live state and unpin its checkpoint: the slot is free for the next step. Idempotent."""
        self.scheduler.remove(run)
        run.released.set()
        restored, run.restored = run.restored, None
        if restored is not None:
            self.metrics.running.dec()
            self.cache.release(restored)
        if not self.scheduler.running:
            self.runtime.adapter.drop_batch()

"""The engine: one worker thread steps every running request forward, under the runtime lock.

A step reads, phase by phase (one module each):

1. admission (`admission`): drop waiting requests that were cancelled or timed out, admit the rest into
   free running slots, plan each one (checkpoint boundaries, sampler, proposer) and, under the lock,
   restore its live state from the prefix cache;
2. cancellations and timeouts of running requests (`finishing`);
3. prefill (`prefill`): about one chunk's worth of prompt tokens, taking checkpoints at the policy's
   boundaries;
4. decode (`decode`): one sampled token for every request past prefill, in one batched pass (or a
   speculative verify pass for a request that has proposals);
5. finishing (`finishing`): a finished request sends its reply, then records its post-decode checkpoint,
   queues idle-time jobs and frees its state.

A reply that does not re-render as generated leaves a job (`background`): its conversation's history as
the next turn sends it, built right after the reply, while nothing runs, and one chunk a step for a request
that waits for it (its prompt extends the job). The HTTP
layer only calls `submit`/`stream`; stream items reach their event loops through the `outbox`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import AsyncIterator

from .. import model_thread
from ..allocator import Trimmer
from ..cache.manager import PrefixCache
from ..cache.namespace import tenant_of
from ..cache.policy import CheckpointPolicy
from ..metrics import Metrics
from ..models.runtime import ModelRuntime
from ..state.caches import cache_nbytes
from ..state.snapshot_blocks import BLOCKS
from .admission import Admission
from .api import SHUTTING_DOWN, ChatPrompt, Emit, Failed, Finished, GenerationRequest
from .background import Background
from .decode import Decode
from .finishing import Finishing
from .outbox import Outbox
from .prefill import Prefill
from .run import Run
from .scheduler import Scheduler
from .speculative import PromptLookup, SpeculativeConfig
from .watchdog import Watchdog

log = logging.getLogger("hyserve.engine")

LIVE_BYTES_EVERY = 1.0  # seconds between samples of the running states' bytes (a walk over their tensors)
SPARE_CHUNKS = 16  # chunks of spare snapshot blocks prepared per idle pass of the worker (`snapshot_blocks`)


class Engine:
    """Schedules requests on a model; a worker thread of its own waits for work and runs each step on
    the process's model thread (see `model_thread`)."""

    def __init__(
        self,
        runtime: ModelRuntime,
        cache: PrefixCache,
        policy: CheckpointPolicy,
        metrics: Metrics,
        prefill_chunk: int = 512,
        speculative: SpeculativeConfig | None = None,
        max_running: int = 8,
        max_waiting: int = 64,
        stall_timeout: float = 60.0,
    ):
        self.runtime = runtime
        self.cache = cache
        self.policy = policy
        self.metrics = metrics
        self.prefill_chunk = prefill_chunk
        self.scheduler = Scheduler(max_running, max_waiting)
        self.outbox = Outbox()
        self.admission = Admission(runtime, cache, policy, metrics, self.scheduler)
        self.background = Background(runtime, cache, policy, metrics, self.scheduler, prefill_chunk)
        self.finishing = Finishing(runtime, cache, policy, metrics, self.scheduler, self.background, self.outbox)
        self.prefill = Prefill(runtime, cache, policy, metrics, self.scheduler, prefill_chunk)
        self.decode = Decode(
            runtime, cache, metrics, self.finishing.finish, self.finishing.settle, self.outbox, prefill_chunk
        )
        if speculative:
            self.make_proposer = lambda prompt: PromptLookup(speculative, prompt)
        self._stopping = False
        self._rebuilding = False
        self._trimmer = Trimmer()
        self._live_sampled = 0.0
        self.watchdog = Watchdog(stall_after=stall_timeout)
        self._worker = threading.Thread(target=self._work, name="hyserve-engine", daemon=True)
        self._worker.start()
        self.watchdog.watch(self._stalled)

    @property
    def make_proposer(self):
        """Builds a proposer (extend(tokens), propose() -> ids) per request; tests may swap in their own."""
        return self.admission.make_proposer

    @make_proposer.setter
    def make_proposer(self, make) -> None:
        self.admission.make_proposer = make

    @property
    def make_sampler(self):
        """SamplingParams -> the request's sampler (logits -> token id); `Sampler` unless replaced."""
        return self.admission.make_sampler

    @make_sampler.setter
    def make_sampler(self, make) -> None:
        self.admission.make_sampler = make

    # -- public API ------------------------------------------------------------------------
    def render_chat(self, messages: list[dict], salt: str = "", template_kwargs: dict | None = None) -> ChatPrompt:
        """Render the prompt and the policy's boundary candidates in one batched tokenization, on the
        caller's thread (the HTTP layer's pool), so the engine's thread never waits on a render.
        `salt`: the tenant's namespace; `template_kwargs`: the request's (tools, ...), given to every render.
        Raises when the prompt itself cannot be rendered."""
        prompt, boundaries, skipped = self.admission.render(messages, None, salt, template_kwargs)
        return ChatPrompt(prompt, boundaries, skipped)

    def submit(self, req: GenerationRequest, emit: Emit) -> None:
        """Queue `req`; `emit` is called from the worker thread. Raises QueueFull at capacity."""
        self._queue(Run(req, emit))

    def _queue(self, run: Run) -> None:
        """Into the waiting queue; a request that arrived before a clear of its tenant (its prompt rendered
        meanwhile) is stale, as if it had been in flight then. Under the scheduler's lock, as `clear_cache`."""
        with self.scheduler.cond:
            self.scheduler.add(run)
            if self.cache.cleared_since(run.req.cache_salt, run.req.arrival):
                self.cache.stale.add(run.req.request_id)

    def clear_cache(self, tenant: str | None = None) -> int:
        """`DELETE /v1/cache` (under the runtime lock): drop `tenant`'s checkpoints (all with None), cancel its
        queued idle-time jobs and make its requests and jobs in flight stale: what they would still record
        is refused (`PrefixCache.record`). The tokenizer forgets its texts too. Returns the number of
        checkpoints dropped."""
        sched = self.scheduler
        if self.runtime.prompt_encoder is not None:
            self.runtime.prompt_encoder.forget(tenant)
        with sched.cond:  # nothing enters or leaves the queues meanwhile
            for job in self.background.cancel(lambda j: tenant is None or tenant_of(j.salt) == tenant):
                self.cache.telemetry.emit(
                    "declined",
                    "cleared",
                    request_id=job.request_id,
                    tenant=tenant_of(job.salt),
                    kind=",".join(b.kind for b in job.stops),
                    tokens=len(job.tokens),
                )
            runs = [*sched.waiting, *sched.running]
            in_flight = {r.req.request_id: r.req.cache_salt for r in runs}
            return self.cache.clear(tenant, in_flight)

    def generate(self, req: GenerationRequest) -> Finished:
        """Blocking: run `req` to completion (benchmarks and tests without HTTP), its post-decode checkpoint
        included. The policy's renders run here, on the caller's thread, as the HTTP layer's do, not on the
        model thread."""
        if req.chat is None and req.messages is not None and self.cache.enabled:
            req.chat = ChatPrompt(req.prompt, *self.admission.boundaries(req))
        done, out = threading.Event(), []

        def emit(item):
            if isinstance(item, (Finished, Failed)):
                out.append(item)
                done.set()

        run = Run(req, emit)
        self._queue(run)
        done.wait()
        if isinstance(out[0], Failed):
            raise RuntimeError(out[0].message)
        run.released.wait()  # its reply comes before its post-decode checkpoint: return once that is taken too
        return out[0]

    def stream(self, req: GenerationRequest) -> AsyncIterator[object]:
        """Queue `req` now (raising QueueFull at capacity) and return an async iterator of its Delta items
        and one Finished (or Failed). Leaving the iteration early cancels the request."""
        emit, items = self.outbox.open(req)
        self.submit(req, emit)
        return items

    @property
    def idle(self) -> bool:
        return self.scheduler.idle and not self._rebuilding and not self.background.pending()

    def problem(self) -> str | None:
        """Why the engine is not making progress (`/health` then says degraded), or None."""
        return self.watchdog.problem(self.scheduler.busy)

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the worker after its current step (a thread left inside torch at exit would abort)."""
        self._stopping = True
        self.watchdog.stop()
        with self.scheduler.cond:
            self.scheduler.cond.notify_all()
        if self._worker is not threading.current_thread():
            self._worker.join(timeout)

    # -- worker ----------------------------------------------------------------------------
    def _work(self) -> None:
        while not self._stopping:
            self.scheduler.wait_for_work(pending=self.background.active is not None)
            self.watchdog.begin()
            try:
                model_thread.run(self.step)  # every engine's model work runs on the one model thread
            except Exception:  # a bug outside every request's guard must not kill the worker
                log.exception("engine step failed")
                if self.watchdog.failed():
                    model_thread.run(self._recover)
            else:
                self.watchdog.succeeded()
            finally:
                self.outbox.flush()
            if len(self.scheduler.running) > 1:  # heap holes come from requests' interleaved allocations
                took = self._trimmer.maybe()
                if took is not None:
                    self.metrics.malloc_trim.observe(took)
            self._sample_live_bytes()
            # Idle: fault in spare snapshot blocks, so that the next checkpoint's copy does not; a request that
            # arrives meanwhile waits for one chunk at most.
            for _ in range(SPARE_CHUNKS):
                if not (self.scheduler.idle and self.cache.enabled and BLOCKS.top_up()):
                    break

    def _recover(self) -> None:
        """Steps keep raising: fail every request they involve (the running ones, else the waiting ones)
        and start again from an empty running list and no decode batch."""
        sched = self.scheduler
        message = f"engine step failed {self.watchdog.failures} times in a row"
        runs = list(sched.running) or sched.take_waiting(lambda run: True)
        log.error("%s: failing %d request(s)", message, len(runs))
        for run in runs:
            self.finishing.fail(run, message)
        self.runtime.adapter.drop_batch()

    def _stalled(self) -> None:
        """The watchdog's thread, while a step has run too long: fail the requests the step holds and those
        waiting behind it."""
        runs = self._fail_all(Failed(f"the engine made no progress for {self.watchdog.stall_after:g} s"))
        if runs:
            log.error("an engine step has run for over %g s: failed %d request(s)", self.watchdog.stall_after, runs)

    def cut_off(self, message: str) -> int:
        """A stopping server's time is up: every request still running or waiting ends with a `Failed` item
        (code "shutting_down"), so that each stream says it was cut, in its route's format, instead of just
        stopping. Any thread; returns how many requests were failed."""
        return self._fail_all(Failed(message, SHUTTING_DOWN))

    def _fail_all(self, failed: Failed) -> int:
        """Answer every running and waiting request with `failed` and cancel it (a step releases it, if one
        ever returns). Nothing else is touched: this runs beside a step that may be stuck."""
        sched = self.scheduler
        runs = [r for r in list(sched.running) if not r.ended] + sched.take_waiting(lambda run: True)
        for run in runs:
            run.req.cancelled.set()
            run.end(failed)
        self.outbox.flush()
        return len(runs)

    def _sample_live_bytes(self) -> None:
        """Set the live-state gauge: what running requests hold beyond the cache's budget, the part of the
        RSS that grows with load (at most `max_running` states and one decode batch). Between steps, so no
        state is changing; at most once a second, and whenever nothing runs (the batch is dropped then: 0)."""
        now = time.monotonic()
        if self.scheduler.running and now - self._live_sampled < LIVE_BYTES_EVERY:
            return  # the common case, once per step: no copy, no walk
        self._live_sampled = now
        caches = [run.state.cache for run in list(self.scheduler.running) if run.restored is not None]
        batch = self.runtime.adapter.batch_cache
        self.metrics.live_bytes.set(cache_nbytes(*caches, *([batch] if batch is not None else [])))

    # -- the step --------------------------------------------------------------------------
    def step(self) -> None:
        sched, guard = self.scheduler, self.finishing.guard
        self.admission.drop_abandoned()
        new = self.admission.admit(guard)
        if not sched.busy and self.background.pending():
            self._rebuilding = True
            try:
                self.background.idle(lambda: self._stopping)
            finally:
                self._rebuilding = False
            return
        with self.runtime.lock:
            held = time.perf_counter()
            self._locked_step(new)
            self.metrics.lock_hold.labels("step").observe(time.perf_counter() - held)

    def _locked_step(self, new: list[Run]) -> None:
        """Every phase's work on one request runs in that request's own guard (`Finishing.guard`): a request
        that raises leaves with a `Failed` item and takes no other request with it."""
        sched, guard = self.scheduler, self.finishing.guard
        waiting = [r for r in sched.running if r.restored is None and self.background.blocks(r)]
        if waiting:  # requests whose history a job is building: a chunk of it, then they restore from it
            self.background.for_waiting(waiting)
        self.admission.restore_all(guard, self.background.blocks)
        self.finishing.reap()
        self.prefill.run([r for r in sched.running if not r.decoding and r.restored is not None], guard)
        self.admission.fork_all(guard)
        decoding = [r for r in sched.running if r.decoding]
        if decoding:
            self.decode.run(decoding, guard, joining=len(sched.running) - len(decoding))
        self.finishing.settle()  # (decode settles before its pass; this catches any finish after it)

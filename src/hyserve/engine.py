"""The engine: one worker thread steps every running request forward, under the runtime lock.

A step (1) admits waiting requests, restoring each from the prefix cache, (2) runs one prefill chunk
of the oldest request still in prefill (and more pieces of prompts that fit in the rest of a budget of
one chunk), taking the policy's checkpoint boundaries from inside the pass where the adapter can
capture the state there (Gated DeltaNet models), else splitting the prompt at them, and
(3) samples one token for every request past prefill and runs them all through one batched decode
pass (or a speculative verify pass for a request that has proposals). Finished requests record the
post-decode checkpoint and free their state at once. The HTTP layer only calls `submit`/`stream`.

Checkpoints that are cheaper to build later than to split the prefill for (the policy says which),
and the re-rendered history of a reply that does not re-tokenize, become background jobs. A job runs
when no request is waiting or running, from the deepest checkpoint, and gives way to real requests;
a new request whose prompt extends a pending job takes the job's checkpoints over as its own
boundaries, so that work is done once, inside the prefill that needs those tokens anyway.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Sequence

from . import model_thread
from .allocator import Trimmer
from .cache.manager import PrefixCache, Restored
from .cache.policy import Boundary, CheckpointPolicy
from .metrics import Metrics
from .runtime import ModelRuntime
from .sampling import Sampler, SamplingParams
from .scheduler import QueueFull, Scheduler
from .sequence import OutputSequence
from .speculative import PromptLookup, SpeculativeConfig, accepted_prefix
from .state import cache_nbytes

log = logging.getLogger("hyserve.engine")

__all__ = ["ChatPrompt", "Delta", "Engine", "Failed", "Finished", "GenerationRequest", "QueueFull"]


@dataclass
class GenerationRequest:
    prompt: list[int]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: Sequence[str] = ()
    messages: list[dict] | None = None  # chat requests: lets the policy find message boundaries
    chat: "ChatPrompt | None" = None  # prompt and boundaries from Engine.render_chat, off the engine's thread
    cache_salt: str = ""  # tenant namespace of the prefix cache
    timeout: float | None = None  # seconds from arrival
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    cancelled: threading.Event = field(default_factory=threading.Event)
    arrival: float = field(default_factory=time.perf_counter)


@dataclass
class Delta:
    text: str
    token_ids: list[int]


@dataclass
class Finished:
    reason: str  # "stop" | "length" | "cancelled" | "timeout"
    text: str
    token_ids: list[int]
    prompt_tokens: int
    cached_tokens: int
    ttft: float | None


@dataclass
class Failed:
    message: str


Emit = Callable[[object], None]


@dataclass
class ChatPrompt:
    """A rendered chat prompt and the checkpoint boundaries the policy found in it."""

    prompt: list[int]
    boundaries: list[Boundary]
    skipped: list[str]  # reasons a boundary was not usable (telemetry)


@dataclass
class _Job:
    """Background work: build the state of `tokens` from the deepest checkpoint, recording each stop."""

    tokens: list[int]
    stops: list[Boundary]  # ascending; the last one may be at len(tokens)
    salt: str
    request_id: str

    def extended_by(self, prompt: Sequence[int], salt: str) -> bool:
        n = len(self.tokens)
        return salt == self.salt and n < len(prompt) and list(prompt[:n]) == self.tokens


# What one more prefill piece in a step costs beyond its tokens, in tokens: its forward pass's fixed cost
# (~9 ms, a decode step) and a checkpoint snapshot (5-10 ms at 2-4k tokens) take together about as long
# as prefilling 40-60 tokens of the bench model here.
PIECE_COST = 64
# Longest the model thread waits, after emitting streams' first tokens, for their event loops to take them
FIRST_TOKEN_HANDOFF = 0.002  # seconds
LIVE_BYTES_EVERY = 1.0  # seconds between samples of the running states' bytes (a walk over their tensors)


def _deliver(pairs: list[tuple[asyncio.Queue, object]]) -> None:
    for queue, item in pairs:
        queue.put_nowait(item)


def _expired(req: GenerationRequest, now: float) -> bool:
    return req.timeout is not None and now - req.arrival > req.timeout


@dataclass
class _Run:
    """A request being served: its live state, what is left to prefill, and its output."""

    req: GenerationRequest
    emit: Emit
    boundaries: list[Boundary] = field(default_factory=list)
    deferred: list[Boundary] = field(default_factory=list)  # left to a background job (policy.split_now)
    checkpoint: int = 0  # deepest checkpoint this request restored or recorded: where a later build starts
    restored: Restored | None = None
    out: OutputSequence | None = None
    sampler: Sampler | None = None
    proposer: object | None = None
    logits: object | None = None  # next-token logits once prefill is done
    snapshots: int = 0  # checkpoints this request recorded (at most one per distinct boundary)
    spec_misses: int = 0  # verify passes in a row that accepted nothing
    spec_cooldown: int = 0  # decode steps to wait before proposing again

    @property
    def state(self):
        return self.restored.state

    @property
    def decoding(self) -> bool:
        return self.logits is not None


class Engine:
    """Schedules requests on a model; a worker thread of its own waits for work and runs each step on
    the process's model thread (see `model_thread`)."""

    def __init__(self, runtime: ModelRuntime, cache: PrefixCache, policy: CheckpointPolicy, metrics: Metrics,
                 prefill_chunk: int = 512, speculative: SpeculativeConfig | None = None,
                 max_running: int = 8, max_waiting: int = 64):
        self.runtime = runtime
        self.cache = cache
        self.policy = policy
        self.metrics = metrics
        self.prefill_chunk = prefill_chunk
        self.scheduler = Scheduler(max_running, max_waiting)
        # Builds a proposer (extend(tokens), propose() -> ids) per request; tests may swap in their own.
        self.make_proposer = (lambda prompt: PromptLookup(speculative, prompt)) if speculative else None
        self._stopping = False
        self._rebuilding = False
        # Items for `stream` consumers, delivered to their event loops in one wake-up per loop (`_flush`):
        # a wake-up per token per request cost the model thread ~3 % at 16 streams. The last field is the
        # stream's `taken` event while its first item is on the way (see `_flush`), else None.
        self._outbox: list[tuple[asyncio.AbstractEventLoop, asyncio.Queue, object, threading.Event | None]] = []
        self._trimmer = Trimmer()
        self._live_sampled = 0.0
        self._worker = threading.Thread(target=self._work, name="hyserve-engine", daemon=True)
        self._worker.start()

    # -- public API ------------------------------------------------------------------------
    def render_chat(self, messages: list[dict], salt: str = "") -> ChatPrompt:
        """Render the prompt and the policy's boundary candidates in one batched tokenization, on the
        caller's thread (the HTTP layer's pool), so the engine's thread never waits on a render.
        `salt`: the tenant's namespace. Raises when the prompt itself cannot be rendered."""
        prompt, boundaries, skipped = self._render(messages, None, salt)
        return ChatPrompt(prompt, boundaries, skipped)

    def _render(self, messages: list[dict], prompt: list[int] | None, salt: str = ""):
        rt = self.runtime
        wanted = self.policy.wanted_renders(messages, rt.has_recurrent_layers) if self.cache.enabled else []
        items = ([] if prompt is not None else [(messages, True)]) + [(m, False) for _, m in wanted]
        rendered = rt.render_many(items, salt) if items else []
        if prompt is None:
            prompt = rendered.pop(0)
            if isinstance(prompt, Exception):
                raise prompt
        boundaries, skipped = self.policy.boundaries_from(prompt, wanted, rendered)
        return prompt, boundaries, skipped

    def _boundaries(self, req: GenerationRequest) -> tuple[list[Boundary], list[str]]:
        """The policy's checkpoint boundaries in `req.prompt`, and why any were skipped; never raises."""
        try:
            _, boundaries, skipped = self._render(req.messages, req.prompt, req.cache_salt)
        except Exception as exc:
            boundaries, skipped = [], [f"policy_failed:{type(exc).__name__}"]
        return boundaries, skipped

    def submit(self, req: GenerationRequest, emit: Emit) -> None:
        """Queue `req`; `emit` is called from the worker thread. Raises QueueFull at capacity."""
        self.scheduler.add(_Run(req, emit))

    def generate(self, req: GenerationRequest) -> Finished:
        """Blocking: run `req` to completion (benchmarks and tests without HTTP). The policy's renders run
        here, on the caller's thread, as the HTTP layer's do, not on the model thread."""
        if req.chat is None and req.messages is not None and self.cache.enabled:
            req.chat = ChatPrompt(req.prompt, *self._boundaries(req))
        done, out = threading.Event(), []

        def emit(item):
            if isinstance(item, (Finished, Failed)):
                out.append(item)
                done.set()

        self.submit(req, emit)
        done.wait()
        if isinstance(out[0], Failed):
            raise RuntimeError(out[0].message)
        return out[0]

    def stream(self, req: GenerationRequest) -> AsyncIterator[object]:
        """Queue `req` now (raising QueueFull at capacity) and return an async iterator of its Delta items
        and one Finished (or Failed). Leaving the iteration early cancels the request."""
        loop = asyncio.get_running_loop()
        items: asyncio.Queue = asyncio.Queue()
        taken = threading.Event()  # set once the consumer has handled the first item and asks for the next

        def emit(item) -> None:
            self._outbox.append((loop, items, item, None if taken.is_set() else taken))

        self.submit(req, emit)
        return self._drain(req, items, taken)

    def _flush(self) -> None:
        """Deliver the `stream` items emitted since the last flush: one call per event loop. Called before
        each forward pass that follows emits, and at the end of every step."""
        if not self._outbox:
            return
        box, self._outbox = self._outbox, []
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        firsts = []
        for loop, queue, item, taken in box:
            by_loop.setdefault(loop, []).append((queue, item))
            if taken is not None:
                firsts.append(taken)
        for loop, pairs in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, pairs)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                pass
        # A stream's first token: let its event loop write it before the next pass takes the GIL back.
        # Otherwise the loop thread waits on a model thread that releases the GIL only briefly, inside
        # each op, and the first chunk left up to a switch interval (5 ms) later.
        deadline = time.perf_counter() + FIRST_TOKEN_HANDOFF
        for taken in firsts:
            taken.wait(max(0.0, deadline - time.perf_counter()))

    async def _drain(self, req: GenerationRequest, items: asyncio.Queue, taken: threading.Event
                     ) -> AsyncIterator[object]:
        try:
            while True:
                item = await items.get()
                yield item
                if not taken.is_set():  # once: Event.set takes a lock, and this runs for every token
                    taken.set()
                if isinstance(item, (Finished, Failed)):
                    return
        finally:
            taken.set()
            req.cancelled.set()

    @property
    def idle(self) -> bool:
        return self.scheduler.idle and not self._rebuilding

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the worker after its current step (a thread left inside torch at exit would abort)."""
        self._stopping = True
        with self.scheduler.cond:
            self.scheduler.cond.notify_all()
        if self._worker is not threading.current_thread():
            self._worker.join(timeout)

    # -- worker ----------------------------------------------------------------------------
    def _work(self) -> None:
        while not self._stopping:
            self.scheduler.wait_for_work()
            try:
                model_thread.run(self.step)  # every engine's model work runs on the one model thread
            except Exception:  # a bug in a step must not kill the worker; the runs involved were failed
                log.exception("engine step failed")
            finally:
                self._flush()
            if len(self.scheduler.running) > 1:  # heap holes come from requests' interleaved allocations
                took = self._trimmer.maybe()
                if took is not None:
                    self.metrics.malloc_trim.observe(took)
            self._sample_live_bytes()

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

    def step(self) -> None:
        sched = self.scheduler
        now = time.perf_counter()
        for run in sched.take_waiting(lambda r: r.req.cancelled.is_set() or _expired(r.req, now)):
            reason = "cancelled" if run.req.cancelled.is_set() else "timeout"
            run.emit(Finished(reason, "", [], len(run.req.prompt), 0, None))
        new = sched.admit()
        self.metrics.waiting.set(len(sched.waiting))
        for run in new:  # renders for checkpoint boundaries happen outside the lock
            self._plan(run)
        rt = self.runtime
        if not sched.busy and sched.background:
            self._rebuilding = True
            try:
                self._run_job(sched.background.pop())
            finally:
                self._rebuilding = False
            return
        with rt.lock:
            held = time.perf_counter()
            self._locked_step(new)
            self.metrics.lock_hold.labels("step").observe(time.perf_counter() - held)

    def _run_job(self, job: _Job) -> None:
        """Idle time: build `job.tokens` from their deepest checkpoint, one chunk per lock hold, recording
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
                    self.scheduler.add_background(_Job(tokens, stops, job.salt, rid))
                    return
                with rt.lock:
                    end = min(stops[0].length, state.position + self.prefill_chunk)
                    rt.adapter.forward(state, tokens[state.position : end])
                    if end == stops[0].length:
                        b = stops.pop(0)
                        self.cache.record(rt.adapter, state, b.kind, b.length, rid, job.salt)
        finally:
            with rt.lock:
                self.cache.release(restored)

    def _locked_step(self, new: list) -> None:
        rt, sched = self.runtime, self.scheduler
        for run in new:
            run.restored = self.cache.restore(rt.adapter, run.req.prompt, run.req.request_id, run.req.cache_salt)
            run.checkpoint = run.restored.cached_tokens
            self.metrics.running.inc()
        now = time.perf_counter()
        for run in list(sched.running):
            r = run.req
            if r.cancelled.is_set():
                self._finish(run, "cancelled")
            elif _expired(r, now):
                self._finish(run, "timeout")
        # Prefill: one chunk of the oldest request in prefill, then, while the step's budget of
        # `prefill_chunk` tokens lasts, further pieces (up to the next boundary or the prompt's end) that fit
        # whole. Short prompts then share a step and join the decode batch sooner (a fuller batch makes more
        # tokens per pass), while a step, and so every stream's inter-token gap, stays about as long as one
        # chunk: each piece is also charged PIECE_COST tokens for its fixed costs (a forward pass, snapshots).
        budget, fit = self.prefill_chunk, None
        for run in [r for r in sched.running if not r.decoding]:
            while budget > 0 and not run.decoding:  # a failed piece (ran None) ends the loop
                ran = self._guard([run], self._prefill_chunk, run, fit)
                if not ran:
                    break
                budget -= ran + PIECE_COST
                fit = budget
            if budget <= 0:
                break
        decoding = [r for r in sched.running if r.decoding]
        if decoding:
            self._guard(decoding, self._decode, decoding)

    def _guard(self, runs, fn, *args):
        """`fn(*args)`, or None after failing `runs` if it raised."""
        try:
            return fn(*args)
        except Exception as exc:  # never leave a client hanging; the cache only holds verified snapshots
            log.exception("request(s) %s failed", [r.req.request_id for r in runs])
            for run in runs:
                if run in self.scheduler.running:
                    self._release(run)
                    run.emit(Failed(f"generation failed: {type(exc).__name__}: {exc}"))

    # -- phases ----------------------------------------------------------------------------
    def _plan(self, run: _Run) -> None:
        req, rt = run.req, self.runtime
        if self.cache.enabled:
            if req.chat is not None and req.chat.prompt == req.prompt:
                run.boundaries, skipped = list(req.chat.boundaries), list(req.chat.skipped)
            else:  # a `submit` caller that did not render them
                run.boundaries, skipped = self._boundaries(req)
            for reason in skipped:
                self.cache.telemetry.emit("skipped", reason, request_id=req.request_id)
            # pending background jobs this prompt extends: their checkpoints are recorded in its prefill
            for job in self.scheduler.take_background(lambda j: j.extended_by(req.prompt, req.cache_salt)):
                known = {b.length for b in run.boundaries}
                run.boundaries += [b for b in job.stops if b.length not in known]
                run.boundaries.sort(key=lambda b: b.length)
        run.sampler = Sampler(req.sampling)
        run.out = OutputSequence(rt.tokenizer, rt.eos_token_ids, req.stop, req.max_tokens, req.arrival,
                                 self.metrics, lambda text, ids: run.emit(Delta(text, list(ids))))
        # Speculation is exact only for greedy decoding (no rejection sampling): off otherwise.
        if self.make_proposer and req.sampling.greedy:
            run.proposer = self.make_proposer(req.prompt)

    def _prefill_chunk(self, run: _Run, fit: int | None = None) -> int:
        """Advance one chunk and snapshot every checkpoint boundary it reaches: boundaries inside the piece
        from states captured in its pass, or, where the adapter cannot capture, a piece never runs past the
        next boundary. With `fit`, run the piece only if it has at most `fit` tokens. Returns the number of
        tokens run."""
        req, state, adapter = run.req, run.state, self.runtime.adapter
        prompt = req.prompt
        while run.boundaries and (run.boundaries[0].length <= state.position
                                  or self.cache.has(prompt[: run.boundaries[0].length], req.cache_salt)):
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
            self.cache.telemetry.emit("deferred", "short_tail", request_id=req.request_id, kind=late.kind,
                                      tokens=late.length, from_tokens=run.checkpoint)
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
                self._record(run, b, states[i] if states else None)
        else:
            logits = adapter.forward(state, prompt[start:end])
        self.metrics.prefill_tokens.inc(end - start)
        log.debug("prefill %s: tokens %d-%d of %d (%d from the cache)", req.request_id, start, end, len(prompt),
                  run.restored.cached_tokens)
        if run.boundaries and run.boundaries[0].length == state.position:
            self._record(run, run.boundaries.pop(0), state)
        if state.position == len(prompt):
            self.metrics.prompt_tokens.inc(len(prompt))
            run.logits = logits
        return end - start

    def _record(self, run: _Run, b: Boundary, state) -> None:
        """Checkpoint `b` from `state` (the live state, or one captured inside the piece; None: not had)."""
        req = run.req
        if state is None:
            self.cache.telemetry.emit("declined", "capture_failed", request_id=req.request_id, kind=b.kind,
                                      tokens=b.length)
        elif self.cache.record(self.runtime.adapter, state, b.kind, b.length, req.request_id, req.cache_salt):
            run.snapshots += 1
            run.checkpoint = b.length

    def _decode(self, runs: list[_Run]) -> None:
        """Sample one token per request; verify speculative runs alone, batch the rest in one pass."""
        batch, tokens = [], []
        for run in runs:
            token = run.sampler(run.logits)
            reason = run.out.push(token)
            if reason is not None:
                self._finish(run, reason)
                continue
            proposals = []
            if run.proposer is not None:
                run.proposer.extend([token])
                if run.spec_cooldown > 0:
                    run.spec_cooldown -= 1
                else:
                    proposals = run.proposer.propose()[: run.req.max_tokens - len(run.out.generated)]
            if proposals:
                self._flush()
                run.logits, reason = self._speculate(run, token, proposals)
                if reason is not None:
                    self._finish(run, reason)
            else:
                batch.append(run)
                tokens.append(token)
        self._flush()  # the tokens just sampled reach their streams before the next pass, not after it
        if batch:
            self.metrics.decode_batch.observe(len(batch))
            adapter, t0 = self.runtime.adapter, time.perf_counter()
            gathers = adapter.gathers
            logits = adapter.forward_batch([r.state for r in batch], tokens)
            self.metrics.decode_pass.observe(time.perf_counter() - t0)
            self.metrics.decode_gathers.inc(adapter.gathers - gathers)
            for i, run in enumerate(batch):
                run.logits = logits[i]

    def _speculate(self, run: _Run, token: int, proposals: list[int]):
        """Verify `proposals` after `token` in one pass; push the accepted ones through the output like
        any decoded token; leave the state at exactly prompt + generated[:-1]. Returns (logits, finish)."""
        adapter, state, out = self.runtime.adapter, run.state, run.out
        t0 = time.perf_counter()
        point = adapter.rollback_point(state)
        all_logits = adapter.forward(state, [token] + proposals, all_logits=True)
        accepted = accepted_prefix(all_logits, proposals)
        keep, reason = accepted + 1, None  # tokens of [token] + proposals the state should hold
        for i, d in enumerate(proposals[:accepted]):
            reason = out.push(d)
            run.proposer.extend([d])
            if reason is not None:
                keep = i + 1
                break
        logits = all_logits[keep - 1]
        if keep < len(proposals) + 1:
            rerun = adapter.rewind(state, point, ([token] + proposals)[:keep])
            if rerun is not None:
                logits = rerun
        # A rejected verify pass costs more than a plain step (recurrent state is restored and re-run),
        # so after passes that accept nothing, stop proposing for 2, 4, ... 32 steps.
        if accepted == 0:
            run.spec_misses += 1
            run.spec_cooldown = min(32, 2 ** run.spec_misses)
        else:
            run.spec_misses = 0
        self.metrics.spec_proposed.inc(len(proposals))
        self.metrics.spec_accepted.inc(keep if reason else accepted)  # proposals emitted as output
        self.metrics.spec_seconds.observe(time.perf_counter() - t0)
        return logits, reason

    def _finish(self, run: _Run, reason: str) -> None:
        req, rt, state = run.req, self.runtime, run.state
        text = run.out.close(reason)
        generated = run.out.generated
        rebuild = None
        if reason in ("cancelled", "timeout") or not run.decoding:
            self.cache.telemetry.emit("declined", reason, request_id=req.request_id, kind="post_decode")
        else:
            render = functools.partial(rt.render_chat, salt=req.cache_salt)
            ok, why, rebuild = self.policy.post_decode_ok(state.tokens, req.messages, text, render,
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
            self._queue_jobs(run, rebuild)
        cached = run.restored.cached_tokens
        self.metrics.snapshots_per_request.observe(run.snapshots)
        self._release(run)
        run.emit(Finished(reason, text, generated, len(req.prompt), cached, run.out.ttft))

    def _queue_jobs(self, run: _Run, rebuild: list[int] | None) -> None:
        """Background jobs for the checkpoints this request deferred and for a re-rendered reply: one job
        when the re-rendered history extends the deferred boundaries (it usually does), else two."""
        req, stops = run.req, list(run.deferred)
        tokens = list(req.prompt[: stops[-1].length]) if stops else []
        if rebuild and not self.cache.has(rebuild, req.cache_salt):
            if stops and list(rebuild[: len(tokens)]) != tokens:
                self.scheduler.add_background(_Job(tokens, stops, req.cache_salt, req.request_id))
                stops = []
            tokens, stops = list(rebuild), stops + [Boundary(len(rebuild), "reply_rerender")]
        if stops:
            self.scheduler.add_background(_Job(tokens, stops, req.cache_salt, req.request_id))

    def _release(self, run: _Run) -> None:
        """Free the live state and unpin its checkpoint: the slot is free for the next step."""
        self.scheduler.remove(run)
        if run.restored is not None:
            self.cache.release(run.restored)
            run.restored = None
            self.metrics.running.dec()
        if not self.scheduler.running:
            self.runtime.adapter.drop_batch()

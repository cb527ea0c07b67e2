"""Decode: one token for every request past prefill.

Each request samples its next token from its logits; a request with speculative proposals verifies them
alone in one pass (prompt lookup, greedy only), and the rest run together through one batched decode pass
whose logits each keeps for the next step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from ..cache.manager import PrefixCache
from ..metrics import Metrics
from ..models.runtime import ModelRuntime
from .logits import token_logprobs
from .outbox import Outbox
from .run import Run
from .speculative import accepted_prefix

log = logging.getLogger("hyserve.engine")


class Decode:
    def __init__(
        self,
        runtime: ModelRuntime,
        cache: PrefixCache,
        metrics: Metrics,
        finish: Callable[[Run, str], None],
        settle: Callable[[], None],
        outbox: Outbox,
        prefill_chunk: int,
    ):
        self.runtime = runtime
        self.cache = cache
        self.metrics = metrics
        self.finish = finish
        self.settle = settle  # flushes the outbox, then records the finished requests' checkpoints
        self.outbox = outbox  # flushed before a verify pass that follows emits (`settle`: before a batched one)
        self.prefill_chunk = prefill_chunk

    def run(self, runs: list[Run], guard: Callable, joining: int = 0) -> None:
        """Sample one token per request; verify speculative runs alone, batch the rest in one pass. Each
        request's own work runs in its own `guard(runs, fn, *args)`, so a request whose sampling, output or
        verify pass raises fails alone. `joining`: requests still in prefill, which will join the batch."""
        batch, tokens = [], []
        for run in runs:
            token = guard([run], self.next_token, run)
            if token is not None:
                batch.append(run)
                tokens.append(token)
        # The tokens just sampled and the replies reach their streams before the pass, not after it; then the
        # finished requests' checkpoints are copied, before the pass can touch their rows.
        self.settle()
        if batch:
            self.forward_batch(batch, tokens, guard, joining)

    def next_token(self, run: Run) -> int | None:
        """Sample and emit the request's next token; with proposals, verify them in a pass of its own.
        Returns the token when it goes into the batched pass, None when the request finished or speculated."""
        row = run.pipeline(run.logits, run.out.generated) if run.pipeline else run.logits
        if run.constraint is not None:  # structured output, after bias and penalties: only what the grammar allows
            row = run.constraint.mask(row)
        if row is None or (row is not run.logits and not bool((row > float("-inf")).any())):
            # a dead end: the grammar allows nothing, or its only tokens are ones min_tokens bans (end of sequence)
            log.warning("request %s: no token is allowed next, ending it", run.req.request_id)
            run.logits = None  # its state holds every generated token, not all but the last: not recorded
            self.finish(run, "stop")
            return None
        token = run.sampler(row)
        if not 0 <= token < run.logits.shape[-1]:
            raise ValueError(f"sampled token {token} is outside the vocabulary")
        if run.constraint is not None and not run.constraint.accept(token):
            raise ValueError(f"sampled token {token} is refused by the request's grammar")
        top = run.req.sampling.logprobs
        reason = run.out.push(token, None if top is None else token_logprobs(row, token, top))
        if reason is not None:
            self.finish(run, reason)
            return None
        proposals = []
        if run.proposer is not None:
            run.proposer.extend([token])
            if run.spec_cooldown > 0:
                run.spec_cooldown -= 1
            else:
                proposals = run.proposer.propose()[: run.req.max_tokens - len(run.out.generated)]
        if not proposals:
            return token
        self.outbox.flush()
        run.logits, reason = self.speculate(run, token, proposals)
        if reason is not None:
            self.finish(run, reason)
        return None

    def forward_batch(self, batch: list[Run], tokens: list[int], guard: Callable, joining: int = 0) -> None:
        """One batched pass: each request keeps its row's logits. When the pass raises, it may already have
        updated some layers' recurrent state in place, in rows that the requests' states view, so no state in
        it is trusted: each request is rebuilt alone (`rebuild`, in its own guard). A request whose own token
        makes a pass fail then fails alone; the others go on from states equal to the ones they lost."""
        self.metrics.decode_batch.observe(len(batch))
        adapter, t0 = self.runtime.adapter, time.perf_counter()
        gathers = adapter.gathers
        try:
            logits = adapter.forward_batch([r.state for r in batch], tokens, room=joining)
        except Exception:
            log.exception("batched decode pass over %d requests failed: rebuilding each one alone", len(batch))
            for run in batch:
                guard([run], self.rebuild, run)
            return
        self.metrics.decode_pass.observe(time.perf_counter() - t0)
        self.metrics.decode_gathers.inc(adapter.gathers - gathers)
        for i, run in enumerate(batch):
            run.logits = logits[i]

    def rebuild(self, run: Run) -> None:
        """A fresh state for prompt + every generated token (the one the failed pass was to run included),
        from the deepest cached checkpoint of those tokens, and the logits after it, as the pass would have
        left them."""
        req, adapter = run.req, self.runtime.adapter
        tokens = list(req.prompt) + list(run.out.generated)
        restored = self.cache.restore(adapter, tokens, req.request_id, req.cache_salt, count=False)
        old, run.restored = run.restored, restored
        if old is not None:
            self.cache.release(old)
        state = restored.state
        while state.position < len(tokens):
            run.logits = adapter.forward(state, tokens[state.position : state.position + self.prefill_chunk])

    @staticmethod
    def verified(run: Run, all_logits, proposals: list[int]) -> int:
        """How many proposals greedy decoding keeps. Under a grammar, row i is masked by the matcher at
        position i, which each verified proposal advances: it only ever holds accepted tokens, so the
        tokens cut after a finish are the only ones it could need back, and then the request has ended."""
        if run.constraint is None:
            return accepted_prefix(all_logits, proposals)
        j = 0
        while j < len(proposals) and run.constraint.allows(all_logits[j], proposals[j]):
            run.constraint.accept(proposals[j])
            j += 1
        return j

    def speculate(self, run: Run, token: int, proposals: list[int]):
        """Verify `proposals` after `token` in one pass; push the accepted ones through the output like
        any decoded token; leave the state at exactly prompt + generated[:-1]. Returns (logits, finish)."""
        adapter, state, out = self.runtime.adapter, run.state, run.out
        t0 = time.perf_counter()
        point = adapter.rollback_point(state)
        all_logits = adapter.forward(state, [token] + proposals, all_logits=True)
        accepted = self.verified(run, all_logits, proposals)
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
            run.spec_cooldown = min(32, 2**run.spec_misses)
        else:
            run.spec_misses = 0
        self.metrics.spec_proposed.inc(len(proposals))
        self.metrics.spec_accepted.inc(keep if reason else accepted)  # proposals emitted as output
        self.metrics.spec_seconds.observe(time.perf_counter() - t0)
        return logits, reason

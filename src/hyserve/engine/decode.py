"""Decode: one token for every request past prefill.

Each request samples its next token from its logits; a request with speculative proposals verifies them
alone in one pass (prompt lookup, greedy only), and the rest run together through one batched decode pass
whose logits each keeps for the next step.
"""

from __future__ import annotations

import time
from typing import Callable

from ..metrics import Metrics
from ..runtime import ModelRuntime
from ..speculative import accepted_prefix
from .outbox import Outbox
from .run import Run


class Decode:
    def __init__(self, runtime: ModelRuntime, metrics: Metrics, finish: Callable[[Run, str], None], outbox: Outbox):
        self.runtime = runtime
        self.metrics = metrics
        self.finish = finish
        self.outbox = outbox  # flushed before each pass that follows emits

    def run(self, runs: list[Run]) -> None:
        """Sample one token per request; verify speculative runs alone, batch the rest in one pass."""
        batch, tokens = [], []
        for run in runs:
            token = run.sampler(run.logits)
            reason = run.out.push(token)
            if reason is not None:
                self.finish(run, reason)
                continue
            proposals = []
            if run.proposer is not None:
                run.proposer.extend([token])
                if run.spec_cooldown > 0:
                    run.spec_cooldown -= 1
                else:
                    proposals = run.proposer.propose()[: run.req.max_tokens - len(run.out.generated)]
            if proposals:
                self.outbox.flush()
                run.logits, reason = self.speculate(run, token, proposals)
                if reason is not None:
                    self.finish(run, reason)
            else:
                batch.append(run)
                tokens.append(token)
        self.outbox.flush()  # the tokens just sampled reach their streams before the next pass, not after it
        if batch:
            self.metrics.decode_batch.observe(len(batch))
            adapter, t0 = self.runtime.adapter, time.perf_counter()
            gathers = adapter.gathers
            logits = adapter.forward_batch([r.state for r in batch], tokens)
            self.metrics.decode_pass.observe(time.perf_counter() - t0)
            self.metrics.decode_gathers.inc(adapter.gathers - gathers)
            for i, run in enumerate(batch):
                run.logits = logits[i]

    def speculate(self, run: Run, token: int, proposals: list[int]):
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

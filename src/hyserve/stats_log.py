"""The periodic engine line: every few seconds while there is work, what vLLM's users read in its log:
prompt and generation throughput, running and waiting requests, the prefix cache's hit rate and fill.

It only reads the service's Prometheus counters and the cache's totals, from a thread of its own, so it
costs the engine nothing. An idle server writes no line; the first interval after the work ends writes
one more, with the last figures.
"""

from __future__ import annotations

import logging
import threading
import time

from .logs import human_bytes

log = logging.getLogger("hyserve.stats")

COUNTERS = {  # field -> Prometheus sample read at each tick
    "prompt": "hyserve_prompt_tokens_total",
    "prefilled": "hyserve_prefill_tokens_computed_total",
    "generated": "hyserve_generation_tokens_total",
    "cached": "hyserve_cache_cached_tokens_total",
}


class StatsLogger:
    """`with StatsLogger(service, interval):` logs the engine line every `interval` s (0: never)."""

    def __init__(self, service, interval: float = 10.0):
        self.service, self.interval = service, interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hyserve-stats", daemon=True)

    def __enter__(self) -> StatsLogger:
        if self.interval > 0:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def sample(self) -> dict:
        registry = self.service.metrics.registry
        out = {k: registry.get_sample_value(name) or 0.0 for k, name in COUNTERS.items()}
        out["running"] = int(registry.get_sample_value("hyserve_requests_running") or 0)
        out["waiting"] = int(registry.get_sample_value("hyserve_requests_waiting") or 0)
        out["time"] = time.monotonic()
        return out

    def line(self, before: dict, now: dict) -> dict | None:
        """The fields of one engine line for the interval between two samples; None when nothing ran."""
        d = {k: now[k] - before[k] for k in COUNTERS}
        if not (now["running"] or now["waiting"] or any(d.values())):
            return None
        seconds = max(now["time"] - before["time"], 1e-9)
        stats = self.service.cache.stats()
        return {
            "prompt_tok_s": round(d["prompt"] / seconds, 1),
            "prefill_tok_s": round(d["prefilled"] / seconds, 1),  # the prompt tokens the model actually ran
            "generation_tok_s": round(d["generated"] / seconds, 1),
            "running": now["running"],
            "waiting": now["waiting"],
            "cache_hit_rate": round(min(1.0, d["cached"] / d["prompt"]), 3) if d["prompt"] else None,
            "cache_entries": stats["entries"],
            "cache_bytes": stats["bytes"],
            "cache_budget_bytes": stats["budget_bytes"],
        }

    def _run(self) -> None:
        before = self.sample()
        while not self._stop.wait(self.interval):
            now = self.sample()
            fields = self.line(before, now)
            before = now
            if fields is None:
                continue
            rate = fields["cache_hit_rate"]
            log.info(
                "Avg prompt throughput: %.1f tokens/s (prefilled %.1f), Avg generation throughput: %.1f "
                "tokens/s, Running: %d reqs, Waiting: %d reqs, Prefix cache hit rate: %s, Cache: %s of %s "
                "(%d entries)",
                fields["prompt_tok_s"],
                fields["prefill_tok_s"],
                fields["generation_tok_s"],
                fields["running"],
                fields["waiting"],
                "-" if rate is None else f"{rate:.1%}",
                human_bytes(fields["cache_bytes"]),
                human_bytes(fields["cache_budget_bytes"]),
                fields["cache_entries"],
                extra={"fields": fields},
            )

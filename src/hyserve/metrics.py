"""Prometheus metrics, one registry per server so tests can run several side by side."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest

_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_FAST = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "hyserve_requests", "Requests by endpoint and outcome", ["endpoint", "status"], registry=r
        )
        self.prompt_tokens = Counter("hyserve_prompt_tokens", "Prompt tokens received", registry=r)
        self.generated_tokens = Counter("hyserve_generation_tokens", "Tokens generated", registry=r)
        self.prefill_tokens = Counter(
            "hyserve_prefill_tokens_computed", "Prompt tokens actually run through the model", registry=r
        )
        self.ttft = Histogram(
            "hyserve_time_to_first_token_seconds", "Time to first token", buckets=_LATENCY, registry=r
        )
        self.itl = Histogram("hyserve_inter_token_latency_seconds", "Time between tokens", buckets=_LATENCY, registry=r)
        self.running = Gauge("hyserve_requests_running", "Requests being generated", registry=r)
        self.cache_hits = Counter("hyserve_cache_hits", "Prefix-cache lookups that restored a checkpoint", registry=r)
        self.cache_misses = Counter(
            "hyserve_cache_misses", "Prefix-cache lookups that found nothing usable", ["reason"], registry=r
        )
        self.cached_tokens = Counter("hyserve_cache_cached_tokens", "Prompt tokens served from the cache", registry=r)
        self.cache_events = Counter("hyserve_cache_events", "Cache decisions", ["event", "reason"], registry=r)
        self.cache_bytes = Gauge("hyserve_cache_bytes", "Bytes held by cached snapshots", registry=r)
        self.cache_state_bytes = Gauge(
            "hyserve_cache_state_bytes",
            "Of hyserve_cache_bytes: cached snapshots' own recurrent/conv states",
            registry=r,
        )
        self.cache_kv_bytes = Gauge(
            "hyserve_cache_kv_bytes",
            "Of hyserve_cache_bytes: attention-KV segments, each counted once however many cached snapshots share it",
            registry=r,
        )
        self.cache_entries = Gauge("hyserve_cache_entries", "Cached snapshots", registry=r)
        self.disk_bytes = Gauge("hyserve_cache_disk_bytes", "Bytes of checkpoint files in the disk tier", registry=r)
        self.disk_entries = Gauge("hyserve_cache_disk_entries", "Checkpoint files in the disk tier", registry=r)
        self.disk_hits = Counter(
            "hyserve_cache_disk_hits", "Lookups served by a checkpoint loaded from disk", registry=r
        )
        self.disk_writes = Counter("hyserve_cache_disk_writes", "Checkpoints written to the disk tier", registry=r)
        self.disk_load_seconds = Histogram(
            "hyserve_cache_disk_load_seconds", "Time to read and verify a disk checkpoint", buckets=_LATENCY, registry=r
        )
        self.cache_evictions = Counter("hyserve_cache_evictions", "Snapshots evicted for the byte budget", registry=r)
        self.snapshot_seconds = Histogram(
            "hyserve_cache_snapshot_seconds", "Time to copy a live state into a snapshot", buckets=_FAST, registry=r
        )
        self.restore_seconds = Histogram(
            "hyserve_cache_restore_seconds", "Time to restore a snapshot into a live state", buckets=_FAST, registry=r
        )
        self.lock_hold = Histogram(
            "hyserve_runtime_lock_hold_seconds",
            "Time the runtime lock is held per cache operation",
            ["op"],
            buckets=_FAST,
            registry=r,
        )
        self.rerender_mismatch = Counter(
            "hyserve_cache_post_decode_rerender_mismatch",
            "Post-decode checkpoints declined because the re-rendered reply did not reproduce the generated ids",
            registry=r,
        )

        self.snapshots_per_request = Histogram(
            "hyserve_cache_snapshots_per_request",
            "Checkpoints recorded per request",
            buckets=(0, 1, 2, 3, 4, 8),
            registry=r,
        )
        self.decode_batch = Histogram(
            "hyserve_decode_batch_size",
            "Requests per batched decode pass",
            buckets=(1, 2, 4, 8, 16, 32, 64),
            registry=r,
        )
        self.decode_pass = Histogram(
            "hyserve_decode_pass_seconds",
            "Time per batched decode pass (the forward for one token of every row)",
            buckets=_FAST,
            registry=r,
        )
        self.decode_gathers = Counter(
            "hyserve_decode_batch_gathers",
            "Batched decode passes that first gathered every request's state afresh (the others reused the batch, "
            "copying at most joining requests into free rows)",
            registry=r,
        )
        self.malloc_trim = Histogram(
            "hyserve_malloc_trim_seconds",
            "Time per hand-back of freed heap memory to the OS (every 10 s while several requests run)",
            buckets=_FAST,
            registry=r,
        )
        self.waiting = Gauge("hyserve_requests_waiting", "Requests queued for a slot", registry=r)
        self.live_bytes = Gauge(
            "hyserve_live_state_bytes",
            "Bytes held by running requests' states and the decode batch (sampled at most once a second)",
            registry=r,
        )
        ProcessCollector(registry=r)  # process_resident_memory_bytes, process_cpu_seconds_total, ... (Linux)
        self.kernel_active = Gauge(
            "hyserve_kernel_active",
            "1 where hyserve's kernel passed the load-time check "
            "against the installed transformers and runs, 0 where transformers' own runs",
            ["kernel"],
            registry=r,
        )
        self.spec_proposed = Counter(
            "hyserve_spec_proposed_tokens", "Speculative tokens proposed (prompt lookup)", registry=r
        )
        self.spec_accepted = Counter("hyserve_spec_accepted_tokens", "Speculative tokens accepted and used", registry=r)
        self.spec_seconds = Histogram(
            "hyserve_spec_verify_seconds", "Time per verify pass incl. rollback", buckets=_FAST, registry=r
        )

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

"""The prefix cache as the engine sees it: look up and restore (fail closed), record, release.

With a disk tier (`disk.py`), a lookup that finds nothing deeper in memory asks the disk; a verified disk
checkpoint is put into the tree and restored from there like any other. Memory evictions and history
boundaries are queued for the disk.

Every restore is verified against the matched tokens (token count and content hash) and, where the
model has attention layers, against the restored KV length (the KV chain must add up to the snapshot's
tokens, and the assembled KV hold exactly the tokens restored). Any mismatch is a miss plus an event and
the entry is dropped; the request then runs from an empty state, so output stays correct.

With `share_kv` (the default), a checkpoint recorded below another on the same path keeps only the
attention KV of its own new tokens and links to the other's (`hyserve.state.kv_chain`).

A clear leaves nothing of the tenant behind: the requests (and idle-time jobs) it had in flight are stale from
then on, and what they would still record is refused, so a replay after the clear restores nothing.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..families import FamilyAdapter
from ..metrics import Metrics
from ..state.kv_chain import KVChainError
from ..state.snapshot import LiveState, token_hash
from .disk import DiskError, DiskTier
from .namespace import tenant_of
from .prefix_tree import PrefixTree, _Node
from .telemetry import CacheTelemetry

# Checkpoints written to disk as they are recorded, not only when evicted: a conversation's boundaries (the
# end of its history, the end of a reply), which its next turn reuses, after a restart too.
WRITE_THROUGH = ("history", "post_decode", "reply_rerender")


@dataclass
class Restored:
    state: LiveState
    cached_tokens: int
    node: _Node | None  # pinned while the request runs; release() unpins


class PrefixCache:
    def __init__(
        self,
        budget_bytes: int,
        metrics: Metrics,
        telemetry: CacheTelemetry,
        enabled: bool = True,
        disk: DiskTier | None = None,
        share_kv: bool = True,
    ):
        self.tree = PrefixTree(budget_bytes)
        self.share_kv = share_kv
        self.disk = disk if enabled else None
        if self.disk is not None:
            self.tree.on_evict = lambda salt, snap: self.disk.put(salt, snap, "evicted")
        self.metrics = metrics
        self.telemetry = telemetry
        self.enabled = enabled
        self.lookups = 0
        self.hits = 0
        self._tenant_counts: dict[str, list[int]] = {}  # tenant -> [lookups, hits]
        self.stale: set[str] = set()  # ids of requests in flight at a clear of their tenant: they record nothing
        self._cleared: dict[str | None, float] = {}  # tenant (None: all) -> perf_counter() of its latest clear

    def _gauges(self) -> None:
        self.metrics.cache_bytes.set(self.tree.total_bytes)
        self.metrics.cache_state_bytes.set(self.tree.state_bytes)
        self.metrics.cache_kv_bytes.set(self.tree.kv_bytes)
        self.metrics.cache_entries.set(self.tree.entries - self.tree.dead)

    def restore(
        self,
        adapter: FamilyAdapter,
        prompt: Sequence[int],
        request_id: str = "",
        salt: str = "",
        count: bool = True,
        keep_last: bool = True,
    ) -> Restored:
        """A live state for `prompt`: restored from the deepest verified checkpoint, or empty.

        `keep_last`: leave at least the last prompt token to run, so the first output token has fresh
        logits. `count=False` (idle-time rebuilds) keeps it out of the hit-rate and cached-token figures."""
        if not self.enabled:
            return Restored(adapter.new_state(), 0, None)
        self.lookups += count
        tenant = tenant_of(salt)
        counts = self._tenant_counts.setdefault(tenant, [0, 0])
        counts[0] += count
        t0 = time.perf_counter()
        max_length, truncate = len(prompt) - keep_last, not adapter.has_recurrent_layers
        match = self.tree.lookup(prompt, max_length=max_length, truncate=truncate, salt=salt)
        if self.disk is not None:
            match = self._from_disk(adapter, prompt, match, max_length, truncate, salt, request_id)
        if match is None:
            if count:
                self.metrics.cache_misses.labels("no_match").inc()
            self.telemetry.emit("miss", "no_match", tenant=tenant, request_id=request_id, prompt_tokens=len(prompt))
            return Restored(adapter.new_state(), 0, None)
        snap, node = match.snapshot, match.node
        expected = prompt[: node.depth] if not match.needs_truncation else node.path_tokens()
        problem = None
        if snap.num_tokens != node.depth:
            problem = "token_count_mismatch"
        elif snap.prefix_hash != token_hash(expected):
            problem = "hash_mismatch"
        state = None
        if problem is None:
            try:
                state = adapter.restore(snap, expected, match.length)
            except KVChainError:
                problem = "kv_length_mismatch"
            else:
                attn = adapter.attention_length(state)
                if attn is not None and attn != match.length:
                    problem = "kv_length_mismatch"
        if problem is not None:
            self.tree.remove(node)
            if self.disk is not None:
                self.disk.discard(salt, snap)
            self._gauges()
            self.metrics.cache_misses.labels(problem).inc()
            self.telemetry.emit(
                "miss",
                problem,
                tenant=tenant,
                request_id=request_id,
                prompt_tokens=len(prompt),
                checkpoint_tokens=snap.num_tokens,
                bytes=snap.nbytes,
            )
            return Restored(adapter.new_state(), 0, None)
        seconds = time.perf_counter() - t0
        self.tree.pin(node)
        if count:
            self.hits += 1
            counts[1] += 1
            self.metrics.cache_hits.inc()
            self.metrics.cached_tokens.inc(match.length)
        self.metrics.restore_seconds.observe(seconds)
        self.metrics.lock_hold.labels("restore").observe(seconds)
        self.telemetry.emit(
            "hit",
            "truncated" if match.needs_truncation else "exact",
            tenant=tenant,
            request_id=request_id,
            prompt_tokens=len(prompt),
            cached_tokens=match.length,
            checkpoint_tokens=snap.num_tokens,
            bytes=snap.nbytes,
            lock_ms=round(seconds * 1e3, 3),
        )
        return Restored(state, match.length, node)

    def _from_disk(
        self,
        adapter: FamilyAdapter,
        prompt: Sequence[int],
        match,
        max_length: int,
        truncate: bool,
        salt: str,
        request_id: str,
    ):
        """The memory match, or a deeper one after loading a verified disk checkpoint into the tree."""
        entry = self.disk.find(prompt, salt, match.length if match is not None else 0, max_length)
        if entry is None:
            return match
        base = dict(tenant=tenant_of(salt), request_id=request_id, checkpoint_tokens=entry.num_tokens)
        t0 = time.perf_counter()
        try:
            snap = self.disk.load(entry, adapter)
        except DiskError as exc:  # the memory match (if any) still serves; the file is gone
            self.telemetry.emit("miss", exc.reason, prompt_tokens=len(prompt), **base)
            return match
        stored, reason, evicted = self.tree.insert(prompt[: entry.num_tokens], snap, salt)
        self._evicted(evicted)
        if not stored:
            self.telemetry.emit("declined", f"disk_load:{reason}", bytes=snap.nbytes, **base)
            return match if match is None or match.node.snapshot is not None else None
        self.telemetry.emit(
            "loaded", "disk", bytes=snap.nbytes, load_ms=round((time.perf_counter() - t0) * 1e3, 3), **base
        )
        return self.tree.lookup(prompt, max_length=max_length, truncate=truncate, salt=salt)

    def has(self, tokens: Sequence[int], salt: str = "") -> bool:
        return self.enabled and self.tree.has(tokens, salt)

    def record(
        self,
        adapter: FamilyAdapter,
        state: LiveState,
        kind: str,
        expected_tokens: int,
        request_id: str = "",
        salt: str = "",
    ) -> bool:
        """Snapshot `state` as a checkpoint if its position is exactly `expected_tokens` and it is new."""
        if not self.enabled:
            return False
        base = dict(request_id=request_id, kind=kind, tokens=expected_tokens, tenant=tenant_of(salt))
        if request_id in self.stale:
            self.telemetry.emit("declined", "cleared", **base)
            return False
        if state.position != expected_tokens:
            self.telemetry.emit("declined", "position_mismatch", position=state.position, **base)
            return False
        attn = adapter.attention_length(state)
        if attn is not None and attn != state.position:
            self.telemetry.emit("declined", "kv_length_mismatch", position=attn, **base)
            return False
        if self.tree.has(state.tokens, salt):
            self.telemetry.emit("skipped", "already_cached", **base)
            return False
        t0 = time.perf_counter()
        snap = adapter.snapshot(state, self.tree.base_for(state.tokens, salt) if self.share_kv else None)
        seconds = time.perf_counter() - t0
        self.metrics.snapshot_seconds.observe(seconds)
        self.metrics.lock_hold.labels("snapshot").observe(seconds)
        stored, reason, evicted = self.tree.insert(state.tokens, snap, salt)
        self._evicted(evicted)
        if stored:
            self.telemetry.emit(
                "recorded",
                kind,
                bytes=snap.nbytes,
                state_bytes=snap.state_nbytes,
                kv_shared_tokens=snap.kv.start if snap.kv is not None else 0,
                lock_ms=round(seconds * 1e3, 3),
                **base,
            )
            if self.disk is not None and kind in WRITE_THROUGH:
                self.disk.put(salt, snap, kind)
        else:
            self.telemetry.emit("declined", reason, bytes=snap.nbytes, **base)
        return stored

    def _evicted(self, evicted) -> None:
        for old in evicted:
            self.metrics.cache_evictions.inc()
            self.telemetry.emit("evicted", "budget", tokens=old.num_tokens, bytes=old.nbytes)
        self._gauges()

    def release(self, restored: Restored) -> None:
        if restored.node is not None:
            self._evicted(self.tree.unpin(restored.node))
            restored.node = None

    def clear(self, tenant: str | None = None, in_flight: Mapping[str, str] | None = None) -> int:
        """Drop every checkpoint (tenant None: an admin's clear) or only `tenant`'s, in memory and on disk.
        `in_flight`: request id -> salt of every request and job the engine holds; those of `tenant` become
        stale, and stale ones no longer in flight are forgotten."""
        self._cleared[tenant] = time.perf_counter()
        if in_flight is not None:
            self.stale = {
                rid
                for rid, salt in in_flight.items()
                if rid in self.stale or tenant is None or tenant_of(salt) == tenant
            }
        removed = self.tree.clear(tenant)
        if self.disk is not None:
            removed += self.disk.clear(tenant)
        self._gauges()
        self.telemetry.emit("cleared", "admin" if tenant is None else "tenant", entries=removed, tenant=tenant)
        return removed

    def cleared_since(self, salt: str, arrival: float) -> bool:
        """Whether `salt`'s tenant was cleared after `arrival` (a perf_counter() time): a request that arrived
        before the clear but reaches the engine after it is stale too."""
        last = max(self._cleared.get(None, -math.inf), self._cleared.get(tenant_of(salt), -math.inf))
        return last > arrival

    def stats(self, tenant: str | None = None) -> dict:
        """Figures for the whole cache, or for `tenant`'s own salts (the byte budget is shared)."""
        entries, state_bytes, kv_bytes = self.tree.usage_split(tenant)
        nbytes = state_bytes + kv_bytes
        lookups, hits = (self.lookups, self.hits) if tenant is None else self._tenant_counts.get(tenant, (0, 0))
        disk = {"enabled": False}
        if self.disk is not None:
            disk_entries, disk_bytes = self.disk.usage(tenant)
            disk = {
                "enabled": True,
                "entries": disk_entries,
                "bytes": disk_bytes,
                "budget_bytes": self.disk.budget_bytes,
            }
            if tenant is None:  # whole-server figures
                disk.update(hits=self.disk.hits, load_seconds=round(self.disk.load_seconds, 6))
        return {
            "enabled": self.enabled,
            "entries": entries,
            "bytes": nbytes,
            "state_bytes": state_bytes,  # recurrent/conv states (and KV kept outside segments)
            "kv_bytes": kv_bytes,  # attention-KV segments, each counted once however many checkpoints share it
            "kv_sharing": self.share_kv,
            "budget_bytes": self.tree.budget_bytes,
            "lookups": lookups,
            "hits": hits,
            "hit_rate": (hits / lookups) if lookups else 0.0,
            "tiers": {
                "memory": {"entries": entries, "bytes": nbytes, "state_bytes": state_bytes, "kv_bytes": kv_bytes},
                "disk": disk,
            },
        }

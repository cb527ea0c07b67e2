"""The disk tier: checkpoints kept in a directory as safetensors files, found again after a restart.

Why a second tier: memory holds a few checkpoints per conversation; a disk holds thousands, and survives
the process. Written: checkpoints evicted from memory and history boundaries as they are recorded (what
the next turn, possibly after a restart, reuses). Writes happen on a thread of their own, so the model
thread never waits for a disk: a recorded snapshot's tensors are never written again, so the writer reads
them while requests run on. Reads happen on the model thread when a lookup finds nothing deeper in memory.

A file holds a standalone snapshot: the KV chain of a memory checkpoint (`hyserve.state.kv_chain`) is assembled
when it is written, and a file loads as a chain of one.

Each file's metadata holds the model fingerprint, the tenant salt, the token count and content hash of
its prefix, the layout and a MAC (HMAC-SHA256) over all of it and every tensor byte, keyed by the directory's
secret (`secret`): a file written by anyone without that key, for any tenant, is refused. A file is used only
when all of these match; anything else (truncated, corrupted, forged, another model's, unreadable) is a miss
with an event and the file is deleted. LRU within a byte budget; last use is the file's mtime, so the order survives.
"""

from __future__ import annotations

import hashlib
import hmac
import io
import json
import os
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import safetensors.torch

from ..metrics import Metrics
from ..state.kv_chain import adopt, standalone
from ..state.snapshot import Snapshot, token_hash
from .namespace import tenant_of
from .secret import directory_key
from .serialize import checksum, from_tensors, to_tensors
from .telemetry import CacheTelemetry

SUFFIX = ".safetensors"
_TMP = ".tmp-"


class DiskError(Exception):
    """A disk entry that may not be used; `reason` is the event's."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


@dataclass
class DiskEntry:
    path: Path
    salt: str
    num_tokens: int
    prefix_hash: str
    nbytes: int
    last_used: float


def _read_header(path: Path) -> dict:
    with open(path, "rb") as f:
        return _header(f)


def _header(f) -> dict:
    """The `__metadata__` of a safetensors file: an 8-byte length, then that much JSON."""
    head = f.read(8)
    if len(head) != 8:
        raise DiskError("disk_truncated")
    n = int.from_bytes(head, "little")
    if n > 100 << 20:
        raise DiskError("disk_bad_header")
    raw = f.read(n)
    if len(raw) != n:
        raise DiskError("disk_truncated")
    try:
        meta = json.loads(raw).get("__metadata__") or {}
    except (ValueError, AttributeError):
        raise DiskError("disk_bad_header") from None
    return meta


class DiskTier:
    def __init__(
        self,
        directory: str | Path,
        budget_bytes: int,
        fingerprint: str,
        metrics: Metrics,
        telemetry: CacheTelemetry,
        max_pending_bytes: int = 2 << 30,
    ):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._key = directory_key(self.dir)
        self.budget_bytes = budget_bytes
        self.fingerprint = fingerprint
        self.metrics = metrics
        self.telemetry = telemetry
        self.hits = 0
        self.load_seconds = 0.0
        self._entries: dict[str, DiskEntry] = {}  # file name -> entry
        self._pending: set[str] = set()
        # evicted snapshots wait in the queue, out of the memory budget: bound what they hold
        self.max_pending_bytes = max_pending_bytes
        self._pending_bytes = 0
        self._epoch = 0  # counts puts; a clear stamps the count, so writes queued before it are dropped
        self._cleared: dict[str | None, int] = {}  # tenant (None: all) -> epoch of its latest clear
        self._lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue()
        self._index()
        self._writer = threading.Thread(target=self._write_loop, name="hyserve-disk-writer", daemon=True)
        self._writer.start()

    # -- index -----------------------------------------------------------------------------
    def _name(self, salt: str, prefix_hash: str, num_tokens: int) -> str:
        key = f"{self.fingerprint}|{salt}|{num_tokens}|{prefix_hash}".encode()
        return hashlib.blake2b(key, digest_size=20).hexdigest() + SUFFIX

    def _index(self) -> None:
        """Take in this model's files (others' are left alone); delete half-written and unreadable ones."""
        for path in self.dir.iterdir():
            if path.name.startswith(_TMP):
                path.unlink(missing_ok=True)  # a write cut short by a crash
                continue
            if not path.name.endswith(SUFFIX):
                continue
            try:
                meta = _read_header(path)
                if meta.get("format") != "hyserve" or meta.get("fingerprint") != self.fingerprint:
                    continue
                entry = DiskEntry(
                    path,
                    meta["salt"],
                    int(meta["num_tokens"]),
                    meta["prefix_hash"],
                    path.stat().st_size,
                    path.stat().st_mtime,
                )
            except (DiskError, KeyError, ValueError, OSError) as exc:
                reason = exc.reason if isinstance(exc, DiskError) else "disk_bad_header"
                self.telemetry.emit("evicted", reason, file=path.name)
                path.unlink(missing_ok=True)
                continue
            if path.name != self._name(entry.salt, entry.prefix_hash, entry.num_tokens):
                self.telemetry.emit("evicted", "disk_misfiled", file=path.name)
                path.unlink(missing_ok=True)
                continue
            self._entries[path.name] = entry
        with self._lock:
            self._evict_over_budget()
        self._gauges()

    def _gauges(self) -> None:
        entries, nbytes = self.usage()
        self.metrics.disk_entries.set(entries)
        self.metrics.disk_bytes.set(nbytes)

    def usage(self, tenant: str | None = None) -> tuple[int, int]:
        with self._lock:
            chosen = [e for e in self._entries.values() if tenant is None or tenant_of(e.salt) == tenant]
        return len(chosen), sum(e.nbytes for e in chosen)

    # -- write (writer thread) -------------------------------------------------------------
    def put(self, salt: str, snapshot: Snapshot, why: str) -> bool:
        """Queue `snapshot` for writing; never blocks. False when already there, larger than the whole
        budget, or when the queue already holds `max_pending_bytes` (the disk is slower than evictions)."""
        name = self._name(salt, snapshot.prefix_hash, snapshot.num_tokens)
        base = dict(tokens=snapshot.num_tokens, bytes=snapshot.nbytes, tenant=tenant_of(salt))
        if snapshot.nbytes > self.budget_bytes:
            self.telemetry.emit("declined", "disk_over_budget", **base)
            return False
        with self._lock:
            if name in self._entries or name in self._pending:
                return False
            full = bool(self._pending) and self._pending_bytes + snapshot.nbytes > self.max_pending_bytes
            if not full:
                self._pending.add(name)
                self._pending_bytes += snapshot.nbytes
                self._epoch += 1
                self._queue.put_nowait((name, salt, snapshot, why, self._epoch))
        if full:
            self.telemetry.emit("declined", "disk_queue_full", **base)
        return not full

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                self._write(*item)
            except Exception as exc:  # a full disk, a vanished directory: the checkpoint stays memory-only
                self.telemetry.emit("declined", f"disk_write_failed:{type(exc).__name__}", tokens=item[2].num_tokens)
            finally:
                if item is not None:
                    with self._lock:
                        self._pending.discard(item[0])
                        self._pending_bytes -= item[2].nbytes
                self._queue.task_done()

    def _cleared_since(self, epoch: int, salt: str) -> bool:
        return epoch <= max(self._cleared.get(None, 0), self._cleared.get(tenant_of(salt), 0))

    def _write(self, name: str, salt: str, snap: Snapshot, why: str, epoch: int) -> None:
        with self._lock:
            if self._cleared_since(epoch, salt):
                return
        try:
            tensors, layout = to_tensors(standalone(snap))
        except TypeError as exc:
            self.telemetry.emit("declined", "disk_unserializable", tokens=snap.num_tokens, detail=str(exc))
            return
        # compact copies: a packed snapshot's tensors are views of one block, which safetensors refuses
        tensors = {k: t.detach().to("cpu").contiguous().clone() for k, t in tensors.items()}
        meta = {
            "format": "hyserve",
            "fingerprint": self.fingerprint,
            "salt": salt,
            "num_tokens": str(snap.num_tokens),
            "prefix_hash": snap.prefix_hash,
            "layout": layout,
        }
        meta["mac"] = checksum(tensors, *_signed(meta), key=self._key)
        path, tmp = self.dir / name, self.dir / f"{_TMP}{name}"
        try:
            safetensors.torch.save_file(tensors, str(tmp), metadata=meta)
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        entry = DiskEntry(path, salt, snap.num_tokens, snap.prefix_hash, path.stat().st_size, time.time())
        with self._lock:
            if self._cleared_since(epoch, salt):  # cleared while it was being written
                path.unlink(missing_ok=True)
                return
            self._entries[name] = entry
            evicted = self._evict_over_budget()
        self.metrics.disk_writes.inc()
        if path.name not in evicted:
            self.telemetry.emit("spilled", why, tokens=snap.num_tokens, bytes=entry.nbytes, tenant=tenant_of(salt))
        self._gauges()

    def _evict_over_budget(self) -> list[str]:
        """Delete least recently used files until the tier fits its budget (call with the lock held)."""
        total, removed = sum(e.nbytes for e in self._entries.values()), []
        for entry in sorted(self._entries.values(), key=lambda e: e.last_used):
            if total <= self.budget_bytes:
                break
            total -= entry.nbytes
            del self._entries[entry.path.name]
            entry.path.unlink(missing_ok=True)
            removed.append(entry.path.name)
            self.telemetry.emit(
                "evicted", "disk_budget", tokens=entry.num_tokens, bytes=entry.nbytes, tenant=tenant_of(entry.salt)
            )
        return removed

    def flush(self) -> None:
        """Wait until every queued write is done (tests; a graceful stop)."""
        self._queue.join()

    def close(self) -> None:
        self._queue.put(None)
        self._writer.join(timeout=30)

    # -- read (model thread) ---------------------------------------------------------------
    def find(self, prompt: Sequence[int], salt: str, min_length: int, max_length: int) -> DiskEntry | None:
        """The deepest entry of `salt` whose tokens are a prefix of `prompt`, longer than `min_length`."""
        with self._lock:
            candidates = sorted(
                (
                    e
                    for e in self._entries.values()
                    if e.salt == salt and min_length < e.num_tokens <= min(max_length, len(prompt))
                ),
                key=lambda e: -e.num_tokens,
            )
        hashes: dict[int, str] = {}  # one hash per distinct length: many chats end at the same one
        for entry in candidates:
            if entry.num_tokens not in hashes:
                hashes[entry.num_tokens] = token_hash(prompt[: entry.num_tokens])
            if hashes[entry.num_tokens] == entry.prefix_hash:
                return entry
        return None

    def load(self, entry: DiskEntry, adapter) -> Snapshot:
        """The verified snapshot of `entry`; raises DiskError (and deletes the file) when it may not be used."""
        t0 = time.perf_counter()
        try:
            snap = self._read(entry, adapter)
        except DiskError as exc:
            self.forget(entry)
            raise exc
        seconds = time.perf_counter() - t0
        self.hits += 1
        self.load_seconds += seconds
        self.metrics.disk_hits.inc()
        self.metrics.disk_load_seconds.observe(seconds)
        entry.last_used = time.time()
        try:
            os.utime(entry.path)  # LRU order that survives a restart
        except OSError:
            pass
        return snap

    def _read(self, entry: DiskEntry, adapter) -> Snapshot:
        try:
            data = entry.path.read_bytes()
        except OSError:
            raise DiskError("disk_unreadable") from None
        meta = _header(io.BytesIO(data))
        expected = {
            "format": "hyserve",
            "fingerprint": self.fingerprint,
            "salt": entry.salt,
            "num_tokens": str(entry.num_tokens),
            "prefix_hash": entry.prefix_hash,
        }
        for key, value in expected.items():
            if meta.get(key) != value:
                raise DiskError(f"disk_{key}_mismatch")
        try:
            tensors = safetensors.torch.load(data)
        except Exception:
            raise DiskError("disk_corrupt") from None
        if not hmac.compare_digest(checksum(tensors, *_signed(meta), key=self._key), str(meta.get("mac", ""))):
            raise DiskError("disk_mac_mismatch")  # damaged, or written without this directory's key
        try:
            cache = from_tensors(adapter.new_state().cache, tensors, meta["layout"], adapter.model.device)
        except (ValueError, KeyError, TypeError, AttributeError):
            raise DiskError("disk_layout_mismatch") from None
        return adopt(cache, entry.num_tokens, entry.prefix_hash)

    def forget(self, entry: DiskEntry) -> None:
        with self._lock:
            self._entries.pop(entry.path.name, None)
        entry.path.unlink(missing_ok=True)
        self._gauges()

    def discard(self, salt: str, snapshot: Snapshot) -> None:
        """Delete the file of a checkpoint that failed its restore checks, so it is never tried again."""
        with self._lock:
            entry = self._entries.get(self._name(salt, snapshot.prefix_hash, snapshot.num_tokens))
        if entry is not None:
            self.forget(entry)

    def clear(self, tenant: str | None = None) -> int:
        """Delete every file, or `tenant`'s."""
        with self._lock:
            self._cleared[tenant] = self._epoch  # and what is queued for it, not yet written
            chosen = [e for e in self._entries.values() if tenant is None or tenant_of(e.salt) == tenant]
            for e in chosen:
                del self._entries[e.path.name]
                e.path.unlink(missing_ok=True)
        self._gauges()
        return len(chosen)


def _signed(meta: dict) -> list[str]:
    """The metadata the checksum covers, besides the tensors."""
    return [meta.get(k, "") for k in ("format", "fingerprint", "salt", "num_tokens", "prefix_hash", "layout")]

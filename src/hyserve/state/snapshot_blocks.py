"""The blocks of memory snapshots are copied into (`state.caches.packed_clones`), recycled.

A snapshot lives in a block mapped for it alone, which goes back to the OS whole when the snapshot is
evicted (see `packed_clones`). Copying into a block mapped afresh faults in every page as it is written,
and on a VM whose host takes back the guest's free pages (free page reporting, ballooning) each of those
faults is a trip to the host: a copy into fresh pages then runs many times slower than one into pages
already touched (`benchmarks/bench_kernels.py --micro` times both). `BlockPool` keeps the last `KEEP`
blocks of `MIN_BYTES` or more that evicted snapshots freed and hands them out again; their sizes are
rounded up to a size class (at most 1/8 more), so that a hybrid model's state parts (one size for the
model) and KV segments of similar lengths find a fitting one. Smaller blocks fault in quickly enough and
are mapped to their exact size, as before. While the engine idles, `top_up` prepares spare blocks of the
size of the last large snapshot, faulting their pages in a chunk at a time, so that the next snapshot does
not fault either before the cache is full and evicts. What the pool keeps is memory beyond the cache's budget: at most
`KEEP` blocks.
`HYSERVE_SNAPSHOT_BLOCKS=0`: nothing is kept or prepared.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
import weakref

KEEP = 8  # blocks kept for reuse, freed or prepared
SPARE = 2  # prepared blocks of the last large size that `top_up` keeps ready
LARGE = 4 << 20  # a snapshot block at least this big is worth preparing in idle time
MIN_BYTES = 1 << 20  # smaller blocks are neither rounded up nor kept
CHUNK = 2 << 20  # bytes of a spare block `top_up` faults in a call


def size_class(nbytes: int) -> int:
    """`nbytes` rounded up to a multiple of 1/8 of its power of two (and of 64 KiB)."""
    step = max(64 << 10, 1 << max(0, nbytes.bit_length() - 4))
    return -(-nbytes // step) * step


class BlockPool:
    def __init__(self, keep: int = KEEP, spare: int = SPARE, large: int = LARGE, min_bytes: int = MIN_BYTES):
        self.keep, self.spare, self.large, self.min_bytes = keep, spare, large, min_bytes
        self._free: list[mmap.mmap] = []  # oldest first
        self._lock = threading.Lock()  # blocks come back on whichever thread drops a snapshot's last tensor
        self._last_large = 0  # size class of the last large block taken: what `top_up` prepares
        self._preparing: list | None = None  # [block, bytes faulted in so far] of the spare `top_up` is making
        self._topping_up = threading.Lock()  # held by the one `top_up` call that may advance `_preparing`
        self.reused = 0  # blocks handed out again (a count for tests and benchmarks)

    @property
    def enabled(self) -> bool:
        return self.keep > 0 and os.environ.get("HYSERVE_SNAPSHOT_BLOCKS", "1") != "0"

    def take(self, nbytes: int) -> memoryview:
        """A writable view of a block of at least `nbytes` (`size_class`; its old contents, if reused, are to
        be overwritten): a kept one of that class when there is one, else one mapped afresh. The block
        comes back to the pool once the view and everything made from it (`torch.frombuffer`) are gone.
        Under `min_bytes`: a block of exactly `nbytes`, mapped afresh and never kept."""
        if nbytes < self.min_bytes or not self.enabled:
            return memoryview(mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS))
        size = size_class(nbytes)
        block = None
        with self._lock:
            if size >= self.large:
                self._last_large = size
            for i in range(len(self._free) - 1, -1, -1):
                if len(self._free[i]) == size:
                    block = self._free.pop(i)
                    self.reused += 1
                    break
        if block is None:
            block = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        view = memoryview(block)
        weakref.finalize(view, self._keep, block).atexit = False
        return view

    def top_up(self) -> bool:
        """Idle time: fault in the next `CHUNK` of a spare block of the last large snapshot's size (written
        with zeros, outside the GIL), keeping it once whole, until `spare` of that size are kept. One chunk
        a call, so a request that arrives meanwhile waits for one chunk at most. Returns whether it did any.
        Every engine's worker calls this on the one pool of the process, outside the model thread: one call
        runs at a time and another meanwhile does nothing, else both could finish the same block and keep it
        twice, and two snapshots would then be copied into it (one overwriting the other)."""
        if not self._topping_up.acquire(blocking=False):
            return False
        try:
            return self._top_up()
        finally:
            self._topping_up.release()

    def _top_up(self) -> bool:
        with self._lock:
            if self._preparing is None:
                size = self._last_large
                if not size or not self.enabled or sum(len(b) == size for b in self._free) >= self.spare:
                    return False
                self._preparing = [mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS), 0]
            block, offset = self._preparing
        n = min(CHUNK, len(block) - offset)
        chunk = (ctypes.c_char * n).from_buffer(block, offset)
        ctypes.memset(chunk, 0, n)
        del chunk  # (the block cannot be closed while a view of it lives)
        if offset + n < len(block):
            self._preparing[1] = offset + n
        else:
            self._preparing = None
            self._keep(block)
        return True

    def _keep(self, block: mmap.mmap) -> None:
        with self._lock:
            self._free.append(block)
            dropped = self._free[: -self.keep] if len(self._free) > self.keep else []
            del self._free[: len(dropped)]
        for old in dropped:
            old.close()  # back to the OS

    def clear(self) -> None:
        with self._lock:
            blocks, self._free = self._free, []
        for block in blocks:
            block.close()

    @property
    def free_bytes(self) -> int:
        with self._lock:
            return sum(len(b) for b in self._free)


BLOCKS = BlockPool()

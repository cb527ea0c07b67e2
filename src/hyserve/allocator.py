"""Hand freed heap memory back to the OS now and then, so a long-running server's RSS follows what it holds.

Under sustained load tensors of many sizes come and go: decode batches, prefill activations, the
states of requests. glibc serves those below its mmap threshold (which it raises to 32 MiB as it sees
large blocks freed) from its heaps, and a heap only shrinks from its top: free memory between live
blocks stays resident. Snapshots, the long-lived part, live outside the heap (`state.caches.packed_clones`),
so the heap stops growing; `malloc_trim(0)` then hands back the free pages inside it. The pages are
faulted in again when reused, so this runs at most once per `interval` seconds, between engine steps,
never under the runtime lock, only while several requests run (their allocations interleave; a lone
request's do not, and a chat's warm turn should not fault its pages in again), and only when the heap's
free chunks hold more than `KEEP_FREE` (less is what the next passes reuse).
`benchmarks/bench_load.py`'s soak counts the trims and their time.

A no-op where the C library has no `malloc_trim` (musl, macOS, Windows) or `HYSERVE_MALLOC_TRIM=0`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import time

TRIM_EVERY = 10.0  # seconds between trims under load


def libc_function(name: str):
    """The C library's function `name` (ctypes), or None where it has none (not glibc, or no C library found)."""
    try:
        return getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), name)
    except (OSError, AttributeError):
        return None


def _malloc_trim():
    fn = libc_function("malloc_trim") if os.environ.get("HYSERVE_MALLOC_TRIM", "1") != "0" else None
    if fn is not None:
        fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8  # mallopt parameters (malloc.h)
KEEP_BELOW = 256 << 20  # blocks up to this size come from the heap, not from a fresh mapping each time
TRIM_ABOVE = 1 << 30  # free memory at the heap's top is handed back on free() only beyond this
KEEP_FREE = 1 << 30  # `Trimmer` hands free heap memory back only when there is more than this


def keep_freed_memory() -> bool:
    """Keep freed activation memory for the next pass instead of handing it to the OS on every free().

    A forward pass at real model sizes allocates and frees blocks of several MB per layer (projections,
    the delta rule's chunk tensors), and a decode batch is gathered afresh (hundreds of MB) as requests come
    and go. glibc maps blocks above its (dynamic) mmap threshold afresh and trims the heap's top whenever
    its free part passes the trim threshold, so the next pass faults the same pages in again, and a page
    fault costs several microseconds in a virtual machine. With a fixed mmap threshold of `KEEP_BELOW` and
    a trim threshold of `TRIM_ABOVE` the pages stay mapped between passes; `Trimmer` still hands the heap's
    free pages back when they pile up. Every thread allocates from the one main arena: glibc gives a thread
    an arena of its own, made of 64 MiB heaps that it unmaps as soon as one is entirely free, whatever the
    trim threshold, and the model thread's decode batches and prefill pieces are mostly such heaps. Call
    it before the model thread starts (a thread that has allocated keeps its arena).
    `benchmarks/bench_real.py --ab-env HYSERVE_MALLOC_KEEP=0` measures it. A no-op without glibc's
    `mallopt` or with `HYSERVE_MALLOC_KEEP=0`; returns whether it applied."""
    if os.environ.get("HYSERVE_MALLOC_KEEP", "1") == "0":
        return False
    fn = libc_function("mallopt")
    if fn is None:
        return False
    fn.argtypes, fn.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return all([fn(M_MMAP_THRESHOLD, KEEP_BELOW), fn(M_TRIM_THRESHOLD, TRIM_ABOVE), fn(M_ARENA_MAX, 1)])


THP_ENV = "THP_MEM_ALLOC_ENABLE"  # PyTorch's switch for transparent huge pages under its CPU allocations


def request_huge_pages() -> None:
    """Ask PyTorch to put its CPU allocations of 2 MiB and more (the weights, attention KV, recurrent states) on
    transparent huge pages, where the kernel allows them (`/sys/kernel/mm/transparent_hugepage/enabled`
    `always` or `madvise`). A block touched for the first time (a decode batch gathered afresh, a prefill
    piece's activations, the weights at load) then costs a page fault per 2 MiB instead of per 4 KiB, and a
    page fault costs microseconds in a virtual machine. A weight already mapped is read at the same speed on
    either (`benchmarks/bench_decode_step.py` measures a product over each). PyTorch reads `THP_MEM_ALLOC_ENABLE` once,
    at its first allocation, so hyserve's commands run this at start (`process_settings.apply`), before
    anything imports torch; in a process that imported torch first it comes too late (set
    THP_MEM_ALLOC_ENABLE=1 there yourself).
    An explicit THP_MEM_ALLOC_ENABLE is left as it is; `HYSERVE_HUGE_PAGES=0` removes it instead (one
    inherited from a parent that imported hyserve included), so PyTorch keeps 4 KiB pages."""
    if os.environ.get("HYSERVE_HUGE_PAGES", "1") == "0":
        os.environ.pop(THP_ENV, None)
    else:
        os.environ.setdefault(THP_ENV, "1")


def huge_page_bytes() -> int | None:
    """This process's anonymous memory on transparent huge pages (`AnonHugePages`), or None where Linux's
    /proc does not say."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


class MallInfo2(ctypes.Structure):
    """glibc's `struct mallinfo2`: its own account of its allocations, over all arenas."""

    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def mallinfo2() -> MallInfo2 | None:
    """glibc's `mallinfo2()`, or None on another C library (or a glibc older than 2.33)."""
    fn = libc_function("mallinfo2")
    if fn is None:
        return None
    fn.argtypes, fn.restype = [], MallInfo2
    return fn()


def free_heap_bytes() -> int | None:
    """Bytes in the C heap's free chunks (`fordblks`), resident or not; None without `mallinfo2`."""
    info = mallinfo2()
    return None if info is None else int(info.fordblks)


def hand_back_freed() -> int | None:
    """Hand the C heap's free pages back to the OS now: at the end of a load, whose temporaries (weights' float
    copies, the kernels' check's probes) no pass reuses, so that they do not stay resident for good under
    `keep_freed_memory`'s trim threshold (`Trimmer` trims only under load, and only above `KEEP_FREE`). Returns
    the free heap bytes it found; None where there is no `malloc_trim` (or `HYSERVE_MALLOC_TRIM=0`)."""
    trim = _malloc_trim()
    if trim is None:
        return None
    free = free_heap_bytes()
    trim(0)
    return free


class Trimmer:
    """`maybe()`: trim if `interval` seconds have passed since the last trim and the heap's free chunks hold
    more than `keep` bytes; returns the seconds it took, or None when it did not run. Below `keep` the free
    memory is what the next passes and decode batches reuse: handed back, each of its pages is faulted in
    again, and under steady load that is every pass's memory (`benchmarks/bench_real.py`'s gather row)."""

    def __init__(self, interval: float = TRIM_EVERY, keep: int = KEEP_FREE):
        self.interval, self.keep = interval, keep
        self._trim = _malloc_trim()
        self._last = time.monotonic()

    @property
    def available(self) -> bool:
        return self._trim is not None

    def maybe(self) -> float | None:
        now = time.monotonic()
        if self._trim is None or now - self._last < self.interval:
            return None
        free = free_heap_bytes()
        if free is not None and free <= self.keep:
            self._last = now
            return None
        self._trim(0)
        self._last = time.monotonic()
        return self._last - now

import ctypes.util
import sys

import pytest

from hyserve import allocator

glibc = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not ctypes.util.find_library("c"), reason="malloc_trim is glibc's"
)


@glibc
def test_trims_at_most_once_per_interval(monkeypatch):
    calls = []
    t = allocator.Trimmer(interval=10.0, keep=0)
    assert t.available
    monkeypatch.setattr(t, "_trim", lambda pad: calls.append(pad) or 1)
    clock = [1000.0]
    monkeypatch.setattr(allocator.time, "monotonic", lambda: clock[0])
    t._last = clock[0]
    assert t.maybe() is None  # not due yet
    clock[0] += 9.9
    assert t.maybe() is None
    clock[0] += 0.2
    assert t.maybe() == 0.0 and calls == [0]
    assert t.maybe() is None and calls == [0]  # the interval starts again


@glibc
def test_real_trim_runs():
    t = allocator.Trimmer(interval=0.0, keep=0)
    junk = [bytearray(1 << 16) for _ in range(200)]  # some freed heap memory to hand back
    del junk
    took = t.maybe()
    assert took is not None and took >= 0.0


def test_switched_off_by_environment(monkeypatch):
    monkeypatch.setenv("HYSERVE_MALLOC_TRIM", "0")
    t = allocator.Trimmer(interval=0.0)
    assert not t.available and t.maybe() is None


def _rss_bytes() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@glibc
def test_freed_activation_memory_stays_mapped_for_the_next_pass():
    """A 96 MiB block (above glibc's largest dynamic mmap threshold, 32 MiB) freed and allocated again: with
    `keep_freed_memory` it comes from the heap and its pages stay resident in between, so the next pass does
    not fault them in again."""
    import torch

    assert allocator.keep_freed_memory()
    block = torch.ones(96 << 20, dtype=torch.uint8)  # written: its pages are resident
    before = _rss_bytes()
    del block
    assert _rss_bytes() > before - (48 << 20)  # not handed back on free()


def test_keep_freed_memory_switched_off_by_environment(monkeypatch):
    monkeypatch.setenv("HYSERVE_MALLOC_KEEP", "0")
    assert allocator.keep_freed_memory() is False


@glibc
def test_free_memory_below_the_bound_is_kept(monkeypatch):
    """A trim is due but the heap's free chunks hold less than `keep`: nothing is handed back (the next
    passes reuse it); above `keep` it trims."""
    calls = []
    t = allocator.Trimmer(interval=0.0, keep=1 << 30)
    monkeypatch.setattr(t, "_trim", lambda pad: calls.append(pad) or 1)
    monkeypatch.setattr(allocator, "free_heap_bytes", lambda: 512 << 20)
    assert t.maybe() is None and calls == []
    monkeypatch.setattr(allocator, "free_heap_bytes", lambda: 2 << 30)
    assert t.maybe() is not None and calls == [0]


@glibc
def test_free_heap_bytes_counts_freed_blocks():
    before = allocator.free_heap_bytes()
    junk = [bytearray(1 << 16) for _ in range(400)]  # 25 MiB from the heap, then freed
    del junk
    assert before is not None and allocator.free_heap_bytes() >= (16 << 20)


_THREAD_SCRIPT = """
import sys, threading
import torch
from hyserve import allocator
allocator.keep_freed_memory()
def rss():
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmRSS:"))
out = {}
def work():
    blocks = [torch.ones(8 << 20, dtype=torch.uint8) for _ in range(24)]  # 192 MiB, written
    out["held"] = rss()
    del blocks
    out["freed"] = rss()
t = threading.Thread(target=work)
t.start(); t.join()
print(out["held"] - out["freed"])
"""


@glibc
@pytest.mark.parametrize("keep", ["1", "0"])
def test_a_threads_freed_blocks_stay_mapped(keep):
    """8 MiB blocks a thread other than the main one allocates and frees (the model thread's decode batches):
    with `keep_freed_memory` they stay resident for the next batch; without it glibc maps each above its
    (dynamic) mmap threshold afresh and unmaps it on free."""
    import os
    import subprocess

    env = {**os.environ, "HYSERVE_MALLOC_KEEP": keep}
    handed_back = int(
        subprocess.run(
            [sys.executable, "-c", _THREAD_SCRIPT], env=env, capture_output=True, text=True, check=True
        ).stdout
    )
    if keep == "1":
        assert handed_back < (32 << 20)
    else:
        assert handed_back > (128 << 20)  # what the setting changes: freed at once otherwise


_ARENA_SCRIPT = """
import ctypes, threading
import torch
from hyserve import allocator
allocator.keep_freed_memory()
held = []
def work():
    held.extend(torch.ones(1 << 20, dtype=torch.uint8) for _ in range(16))  # 16 MiB, kept while stats print
t = threading.Thread(target=work)
t.start(); t.join()
ctypes.CDLL("libc.so.6").malloc_stats()
"""


@glibc
@pytest.mark.parametrize("keep", ["1", "0"])
def test_another_threads_allocations_come_from_the_main_arena(keep):
    """glibc would give the thread an arena of its own (`Arena 1` in `malloc_stats`), whose heaps it unmaps as
    they empty whatever the trim threshold; with `keep_freed_memory` there is only the main arena."""
    import os
    import subprocess

    env = {**os.environ, "HYSERVE_MALLOC_KEEP": keep}
    stats = subprocess.run(
        [sys.executable, "-c", _ARENA_SCRIPT], env=env, capture_output=True, text=True, check=True
    ).stderr
    assert "Arena 0:" in stats
    assert ("Arena 1:" in stats) == (keep == "0")


_HUGE_SCRIPT = """
from hyserve import allocator, process_settings
process_settings.apply()  # as hyserve's commands do first
import torch
t = torch.empty(64 << 20, dtype=torch.uint8)
t.fill_(1)  # faulted in: on huge pages where PyTorch asked for them
print(allocator.huge_page_bytes())
"""


def _thp_mode() -> str | None:
    try:
        text = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return None
    return text[text.index("[") + 1 : text.index("]")] if "[" in text else None


@pytest.mark.parametrize("asked", [True, False])
def test_the_process_settings_put_torchs_large_allocations_on_huge_pages(asked):
    """hyserve's commands ask PyTorch for transparent huge pages before torch is imported: a 64 MiB tensor then
    lies on them; with HYSERVE_HUGE_PAGES=0 (and the kernel giving huge pages only to who asks) it does not."""
    import os
    import subprocess

    mode = _thp_mode()
    if mode not in ("always", "madvise") or (not asked and mode != "madvise"):
        pytest.skip(f"transparent huge pages are {mode!r} here")
    env = {**os.environ, allocator.THP_ENV: "1"}  # as a child of a hyserve command inherits it
    env["HYSERVE_HUGE_PAGES"] = "1" if asked else "0"
    huge = int(
        subprocess.run(
            [sys.executable, "-c", _HUGE_SCRIPT], env=env, capture_output=True, text=True, check=True
        ).stdout.split()[-1]
    )
    assert (huge >= 32 << 20) if asked else huge == 0, huge

import ctypes.util
import sys

import pytest

from hyserve import allocator


glibc = pytest.mark.skipif(not sys.platform.startswith("linux") or not ctypes.util.find_library("c"),
                           reason="malloc_trim is glibc's")


@glibc
def test_trims_at_most_once_per_interval(monkeypatch):
    calls = []
    t = allocator.Trimmer(interval=10.0)
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
    t = allocator.Trimmer(interval=0.0)
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

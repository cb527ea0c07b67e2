"""Snapshot blocks are recycled (`hyserve.state.snapshot_blocks`): a block comes back only when nothing views it,
goes out again only to a snapshot of its size class, and never while a live snapshot still uses it."""

import ctypes
import gc
import threading

import pytest
import torch

from hyserve.state.caches import packed_clones
from hyserve.state.snapshot_blocks import CHUNK, BlockPool, size_class


def _tensors(seed=0, rows=512):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(rows, 1024, generator=g), torch.randn(7, 33, generator=g).bfloat16()]


def test_size_classes_round_up_by_at_most_an_eighth():
    for n in (1, 4095, 65536, 65537, 3 << 20, (3 << 20) + 1, 21_600_000, 1 << 30):
        c = size_class(n)
        assert c >= n and c % (64 << 10) == 0 and (c - n) <= max(64 << 10, n // 8)
    assert size_class(21_600_000) == size_class(21_500_000)  # near sizes share a class


def test_a_freed_block_goes_to_the_next_snapshot_of_its_size_and_never_to_a_live_one(monkeypatch):
    pool = BlockPool(keep=2, min_bytes=0)
    monkeypatch.setattr("hyserve.state.caches.BLOCKS", pool)
    src = _tensors(0)
    live = packed_clones(src)
    first = packed_clones(_tensors(1))
    address = first[0].data_ptr()
    del first
    gc.collect()
    assert pool.free_bytes > 0
    again = packed_clones(src)
    assert again[0].data_ptr() == address and pool.reused == 1  # the freed block, not a new one
    assert all(torch.equal(a, b) for a, b in zip(again, src))
    assert live[0].data_ptr() != address and all(torch.equal(a, b) for a, b in zip(live, src))  # untouched
    view = again[1]
    del again
    assert pool.free_bytes == 0  # one of its tensors still lives: the block stays with it
    del view
    assert pool.free_bytes > 0
    other = packed_clones(_tensors(2, rows=4096))  # another size class: a new block
    assert pool.reused == 1 and other[0].data_ptr() != address


def test_the_pool_keeps_at_most_keep_blocks(monkeypatch):
    pool = BlockPool(keep=2, min_bytes=0)
    monkeypatch.setattr("hyserve.state.caches.BLOCKS", pool)
    copies = [packed_clones(_tensors(i)) for i in range(5)]
    size = copies[0][0].untyped_storage().nbytes()
    del copies
    gc.collect()
    assert pool.free_bytes == 2 * size


def test_top_up_prepares_spares_of_the_last_large_size(monkeypatch):
    pool = BlockPool(keep=4, spare=2, large=1 << 20, min_bytes=0)
    monkeypatch.setattr("hyserve.state.caches.BLOCKS", pool)
    assert not pool.top_up()  # no large snapshot yet: nothing to prepare
    kept = packed_clones(_tensors(0))  # 2 MiB: large
    size = kept[0].untyped_storage().nbytes()
    calls = 0
    while pool.top_up():  # a chunk a call, until two spares are whole
        calls += 1
        assert pool.free_bytes in (0, size, 2 * size)
    assert pool.free_bytes == 2 * size and calls == 2 * -(-size // CHUNK)
    nxt = packed_clones(_tensors(1))
    assert pool.reused == 1 and pool.free_bytes == size and all(torch.equal(a, b) for a, b in zip(nxt, _tensors(1)))


def test_small_blocks_and_a_pool_switched_off_keep_nothing(monkeypatch):
    pool = BlockPool(min_bytes=4 << 20)
    monkeypatch.setattr("hyserve.state.caches.BLOCKS", pool)
    copies = packed_clones(_tensors(0))  # 2 MiB: exact size, unmapped when dropped
    assert copies[0].untyped_storage().nbytes() < (2 << 20) + 4096
    del copies
    gc.collect()
    assert pool.free_bytes == 0
    pool = BlockPool(min_bytes=0)
    monkeypatch.setattr("hyserve.state.caches.BLOCKS", pool)
    monkeypatch.setenv("HYSERVE_SNAPSHOT_BLOCKS", "0")
    copies = packed_clones(_tensors(0))
    del copies
    gc.collect()
    assert pool.free_bytes == 0 and not pool.top_up()


@pytest.mark.parametrize("arch", ["qwen3_5", "mamba2"])
def test_recycled_blocks_keep_cached_turns_equal_to_cache_off(make_service, arch, monkeypatch):
    """A budget that evicts all the time recycles blocks between checkpoints: output still equals cache-off."""
    from .test_engine_cache import run_chat

    pool = BlockPool(keep=8, large=1, min_bytes=0)  # every block recycled, and topped up while the engine idles
    monkeypatch.setattr("hyserve.state.caches.BLOCKS", pool)
    monkeypatch.setattr("hyserve.engine.core.BLOCKS", pool)
    on = run_chat(make_service(arch, cache_bytes=2 << 20))
    off = run_chat(make_service(arch, cache_enabled=False))
    assert [r[0] for r in on] == [r[0] for r in off], [r[1] for r in on]  # a failure shows each turn's cached tokens
    assert pool.reused > 0 and sum(r[1] > 0 for r in on) >= 3  # blocks were reused, and turns were cached


def test_two_threads_topping_up_at_once_never_keep_one_block_twice(monkeypatch):
    """Every engine's worker tops up the one process-wide pool (an idle engine wakes every half second): a
    block two of them prepared at once must be kept once, or two snapshots would share it and one overwrite
    the other."""
    pool = BlockPool(keep=4, spare=2, large=1, min_bytes=0)
    monkeypatch.setattr("hyserve.state.caches.BLOCKS", pool)
    packed_clones(_tensors(0, rows=256))  # 1 MiB, one chunk: the size `top_up` prepares
    first_in, second_done, memset = threading.Event(), threading.Event(), ctypes.memset

    def held_memset(ptr, value, n):  # the first caller stays inside its chunk until the second has run
        if threading.current_thread() is first:
            first_in.set()
            second_done.wait(10)
        return memset(ptr, value, n)

    monkeypatch.setattr(ctypes, "memset", held_memset)
    first = threading.Thread(target=pool.top_up)
    first.start()
    assert first_in.wait(10)
    pool.top_up()
    second_done.set()
    first.join(10)
    a, b = _tensors(1, rows=256), _tensors(2, rows=256)
    copy_a, copy_b = packed_clones(a), packed_clones(b)
    assert copy_a[0].data_ptr() != copy_b[0].data_ptr()
    assert all(torch.equal(x, y) for x, y in zip(copy_a, a)) and all(torch.equal(x, y) for x, y in zip(copy_b, b))

"""Attention KV stored once along the tree (hyserve.state.kv_chain): a checkpoint below another keeps only the KV of
its new tokens, restores bit-identical to the state it recorded, costs about its state plus those tokens'
KV, and survives its ancestor's eviction; anything not bit-identical is stored whole."""

import gc
import weakref

import pytest
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from hyserve.cache.disk import DiskTier
from hyserve.cache.manager import PrefixCache
from hyserve.cache.telemetry import CacheTelemetry
from hyserve.metrics import Metrics
from hyserve.state import kv_chain
from hyserve.state.caches import cache_tensors
from hyserve.testing.tiny import ARCHS

from .test_state import _greedy, _ids

KV_FREE = ("mamba2",)  # no attention layer at all


def _same_bits(a, b) -> bool:
    return kv_chain._same_bits(a, b)


def _assert_bit_identical(restored, recorded):
    """Every tensor of the restored state equals the recorded state's bit for bit, and its tokens."""
    got, want = list(cache_tensors(restored.cache)), list(cache_tensors(recorded.cache))
    assert len(got) == len(want)
    assert all(_same_bits(a, b) for a, b in zip(got, want))
    assert restored.tokens == recorded.tokens


def _cache(budget=1 << 30, share_kv=True, disk=None):
    metrics = Metrics()
    return PrefixCache(budget, metrics, CacheTelemetry(metrics), disk=disk, share_kv=share_kv)


@pytest.mark.parametrize("arch", ARCHS)
def test_restore_through_a_shared_chain_is_bit_identical_to_the_recorded_state(runtimes, arch):
    """Every family: hybrid layers holding KV and a state (Falcon-H1, Zamba2), pure SSM (no KV: no chain)."""
    rt = runtimes(arch)
    ad = rt.adapter
    ids = _ids(rt, 60, seed=7)
    live = ad.new_state()
    ad.forward(live, ids[:20])
    top = ad.snapshot(live)
    live = ad.restore(top, ids[:20])  # as a request restored from the checkpoint runs on
    ad.forward(live, ids[20:35])
    low = ad.snapshot(live, base=top)
    if arch in KV_FREE:
        assert low.kv is None and top.kv is None
    else:
        assert low.kv.parent is top.kv and (low.kv.start, low.kv.end) == (20, 35)
        assert low.state_nbytes + low.kv.nbytes < low.nbytes  # it holds the first 20 tokens' KV only by reference
    ref = ad.new_state()
    ref_logits = ad.forward(ref, ids)
    ref_cont = _greedy(ad, ref, ref_logits, 6)
    for _ in range(2):  # restoring leaves the chain untouched
        got = ad.restore(low, ids[:35])
        _assert_bit_identical(got, live)
        logits = ad.forward(got, ids[35:])
        torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-5)
        assert _greedy(ad, got, logits, 6) == ref_cont


def test_a_kv_prefix_that_is_not_bit_identical_is_stored_whole(runtimes):
    """Sharing needs the very bits: a live KV that differs from the ancestor's chain in one element's sign
    of zero (equal as floats: torch.equal would share) gets a chain of one."""
    rt = runtimes("qwen3_5")
    ad = rt.adapter
    ids = _ids(rt, 40, seed=8)
    live = ad.new_state()
    ad.forward(live, ids[:20])
    layer = next(layer for layer in live.cache.layers if isinstance(layer, DynamicLayer))
    layer.keys = layer.keys.clone()
    layer.keys[0, 0, 3, 0] = 0.0
    top = ad.snapshot(live)
    layer.keys[0, 0, 3, 0] = -0.0
    ad.forward(live, ids[20:30])
    low = ad.snapshot(live, base=top)
    assert low.kv.parent is None and low.kv.start == 0 and low.nbytes == low.state_nbytes + low.kv.nbytes
    _assert_bit_identical(ad.restore(low, ids[:30]), live)
    other = ad.new_state()  # a checkpoint of other tokens is no ancestor either
    ad.forward(other, ids[20:40])
    assert ad.snapshot(live, base=ad.snapshot(other)).kv.parent is None


def test_a_second_checkpoint_100_tokens_deeper_costs_its_state_and_100_tokens_of_kv(runtimes):
    rt = runtimes("qwen3_5")
    ad = rt.adapter
    ids = _ids(rt, 420, seed=9)
    for share in (True, False):
        cache = _cache(share_kv=share)
        live = ad.new_state()
        ad.forward(live, ids[:300])
        assert cache.record(ad, live, "history", 300)
        first = cache.tree.total_bytes
        ad.forward(live, ids[300:400])
        assert cache.record(ad, live, "post_decode", 400)
        deeper = cache.tree.lookup(ids[:401], 400, False).snapshot
        added = cache.tree.total_bytes - first
        if share:
            assert (deeper.kv.start, deeper.kv.end) == (300, 400)
            assert added == deeper.state_nbytes + deeper.kv.nbytes
            whole_kv = deeper.kv_nbytes
            # 100 of 400 tokens of KV (each segment's tensors are rounded up to 64 bytes)
            assert deeper.kv.nbytes <= whole_kv * 100 / 400 + 64 * 4
            assert added < first  # less than the first checkpoint, which holds 300 tokens of KV
            stats = cache.stats()
            assert stats["kv_sharing"] and stats["bytes"] == stats["state_bytes"] + stats["kv_bytes"]
            assert stats["kv_bytes"] == whole_kv and cache.metrics.cache_kv_bytes._value.get() == whole_kv
        else:  # the escape hatch: every checkpoint holds its whole KV
            assert deeper.kv.parent is None and added == deeper.nbytes > first
            assert not cache.stats()["kv_sharing"]


def _chat(ad, cache, ids, cuts):
    """Checkpoints of one growing conversation at each of `cuts`, each turn restored from the cache as the
    engine does; returns the live state recorded at each cut."""
    recorded = {}
    for cut in cuts:
        restored = cache.restore(ad, ids[: cut + 1])
        live = restored.state
        ad.forward(live, ids[live.position : cut])
        cache.release(restored)
        assert cache.record(ad, live, "history", cut)
        recorded[cut] = live
    return recorded


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3"])
def test_evicting_an_inner_checkpoint_frees_only_its_state_and_keeps_the_deeper_one_exact(runtimes, arch):
    rt = runtimes(arch)
    ad = rt.adapter
    ids = _ids(rt, 90, seed=10)
    cache = _cache()
    recorded = _chat(ad, cache, ids, [20, 40, 60])
    nodes = {s.num_tokens: (n, s) for n, s in cache.tree.snapshots()}
    assert nodes[60][1].kv.parent is nodes[40][1].kv and nodes[40][1].kv.parent is nodes[20][1].kv
    before, inner = cache.tree.total_bytes, nodes[40][1]
    cache.tree.remove(nodes[40][0])
    assert cache.tree.total_bytes == before - inner.state_nbytes  # its KV segment is still the deeper one's
    ref = ad.new_state()
    ref_logits = ad.forward(ref, ids)
    restored = cache.restore(ad, ids)
    assert restored.cached_tokens == 60
    _assert_bit_identical(restored.state, recorded[60])
    logits = ad.forward(restored.state, ids[60:])
    torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-5)
    assert _greedy(ad, restored.state, logits, 6) == _greedy(ad, ref, ref_logits, 6)
    cache.release(restored)


def test_evicting_everything_frees_every_byte_and_every_segment(runtimes):
    rt = runtimes("qwen3_5")
    ad = rt.adapter
    ids = _ids(rt, 80, seed=11)
    cache = _cache()
    recorded = _chat(ad, cache, ids, [15, 30, 45, 60])
    segments = [weakref.ref(s.kv) for _, s in cache.tree.snapshots()]
    assert cache.tree.kv_bytes > 0 and cache.tree.state_bytes > 0
    del recorded
    assert cache.clear() == 4
    assert (cache.tree.total_bytes, cache.tree.state_bytes, cache.tree.kv_bytes) == (0, 0, 0)
    assert cache.stats()["bytes"] == 0 and cache.metrics.cache_bytes._value.get() == 0
    gc.collect()
    assert all(ref() is None for ref in segments)  # nothing else kept them alive


def test_budget_eviction_counts_the_bytes_it_really_frees(runtimes):
    """A budget that fits the conversation's deepest checkpoint and little else: eviction goes on until the
    real bytes (states and KV segments counted once) fit, and what stays restores exactly."""
    rt = runtimes("qwen3_5")
    ad = rt.adapter
    ids = _ids(rt, 90, seed=12)
    probe = _cache()
    recorded = _chat(ad, probe, ids, [20, 40, 60])
    deepest = max((s for _, s in probe.tree.snapshots()), key=lambda s: s.num_tokens)
    budget = deepest.nbytes + deepest.state_nbytes // 2
    cache = _cache(budget=budget)
    recorded = _chat(ad, cache, ids, [20, 40, 60])
    assert cache.tree.total_bytes <= budget
    kept = {s.num_tokens for _, s in cache.tree.snapshots()}
    assert 60 in kept and len(kept) < 3
    restored = cache.restore(ad, ids)
    _assert_bit_identical(restored.state, recorded[60])
    cache.release(restored)


@pytest.mark.parametrize("depths", [(20, 40), (40,)])  # a chain of several segments, and a chain of one
def test_a_live_request_survives_its_checkpoints_eviction(runtimes, depths):
    rt = runtimes("qwen3_5")
    ad = rt.adapter
    ids = _ids(rt, 70, seed=13)
    cache = _cache()
    recorded = _chat(ad, cache, ids, depths)
    restored = cache.restore(ad, ids)
    live = restored.state
    cache.release(restored)
    assert cache.clear() == len(depths) and cache.tree.total_bytes == 0
    gc.collect()
    _assert_bit_identical(live, recorded[depths[-1]])
    ref = ad.new_state()
    ref_logits = ad.forward(ref, ids)
    logits = ad.forward(live, ids[depths[-1] :])
    torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-5)
    assert _greedy(ad, live, logits, 6) == _greedy(ad, ref, ref_logits, 6)


def test_attention_only_cut_assembles_the_chain_up_to_the_cut(runtimes):
    """Truncate mode: a snapshot below the divergence point is cut back to the match; only the segments up
    to the cut are joined, into compact tensors of their own."""
    rt = runtimes("qwen3")
    ad = rt.adapter
    ids = _ids(rt, 80, seed=14)
    cache = _cache()
    recorded = _chat(ad, cache, ids, [20, 50])[50]
    other = _ids(rt, 30, seed=15)
    for cut in (35, 12):  # inside the second segment, inside the first
        prompt = ids[:cut] + other
        restored = cache.restore(ad, prompt)
        assert restored.cached_tokens == cut and restored.state.tokens == ids[:cut]
        for layer, want in zip(restored.state.cache.layers, recorded.cache.layers):
            assert layer.keys.shape[-2] == cut and layer.keys.is_contiguous()
            assert layer.keys.untyped_storage().nbytes() == layer.keys.numel() * layer.keys.element_size()
            assert _same_bits(layer.keys, want.keys[..., :cut, :]) and _same_bits(
                layer.values, want.values[..., :cut, :]
            )
        ref = ad.new_state()
        ref_logits = ad.forward(ref, prompt)
        logits = ad.forward(restored.state, prompt[cut:])
        torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-5)
        assert _greedy(ad, restored.state, logits, 6) == _greedy(ad, ref, ref_logits, 6)
        cache.release(restored)


def test_a_damaged_chain_is_a_miss_never_a_restore(runtimes):
    rt = runtimes("qwen3")
    ad = rt.adapter
    ids = _ids(rt, 60, seed=16)
    cache = _cache()
    _chat(ad, cache, ids, [20, 40])
    low = next(s for _, s in cache.tree.snapshots() if s.num_tokens == 40)
    low.kv.start = 19  # claims to follow its parent one token early
    assert cache.restore(ad, ids).cached_tokens == 0  # a miss: the request runs from an empty state
    assert any(e["reason"] == "kv_length_mismatch" for e in cache.telemetry.recent)
    assert {s.num_tokens for _, s in cache.tree.snapshots()} == {20}  # the damaged checkpoint is dropped
    assert cache.tree.total_bytes == next(s for _, s in cache.tree.snapshots()).nbytes
    restored = cache.restore(ad, ids)
    assert restored.cached_tokens == 20
    cache.release(restored)


def test_the_disk_tier_writes_a_chain_whole_and_loads_it_as_a_chain_of_one(runtimes, tmp_path):
    rt = runtimes("qwen3_5")
    ad = rt.adapter
    ids = _ids(rt, 70, seed=17)
    metrics = Metrics()
    telemetry = CacheTelemetry(metrics)
    disk = DiskTier(tmp_path, 1 << 30, "test", metrics, telemetry)
    try:
        cache = PrefixCache(1 << 30, metrics, telemetry, disk=disk)
        recorded = _chat(ad, cache, ids, [20, 40])
        disk.flush()
        low = next(s for _, s in cache.tree.snapshots() if s.num_tokens == 40)
        assert low.kv.parent is not None
        cache.tree.clear()  # memory forgets: the next lookup reads the file
        restored = cache.restore(ad, ids)
        assert restored.cached_tokens == 40 and disk.hits == 1
        loaded = next(s for _, s in cache.tree.snapshots() if s.num_tokens == 40)
        assert loaded.kv.parent is None and (loaded.kv.start, loaded.kv.end) == (0, 40)
        exact = sum(t.numel() * t.element_size() for pair in loaded.kv.layers if pair for t in pair)
        assert loaded.kv.nbytes == exact  # each tensor counted by its own storage, once
        _assert_bit_identical(restored.state, recorded[40])
        cache.release(restored)
    finally:
        disk.close()


def test_sliding_window_kv_stays_in_the_state_part():
    """A sliding window drops old tokens: never a segment, copied whole with the state; full-attention KV
    beside it goes to the segment."""
    cache = DynamicCache()
    cache.layers = [DynamicLayer(), DynamicSlidingWindowLayer(sliding_window=4)]
    for layer in cache.layers:
        layer.lazy_initialization(torch.zeros(1, 2, 0, 8), torch.zeros(1, 2, 0, 8))
    cache.layers[0].keys, cache.layers[0].values = torch.randn(1, 2, 10, 8), torch.randn(1, 2, 10, 8)
    cache.layers[1].keys, cache.layers[1].values = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8)
    snap = kv_chain.split(cache, 10, "h")
    assert snap.kv.layers[0] is not None and len(snap.kv.layers) == 1
    assert snap.cache.layers[0].keys is None and torch.equal(snap.cache.layers[1].keys, cache.layers[1].keys)
    whole = kv_chain.standalone(snap)
    assert all(torch.equal(a, b) for a, b in zip(cache_tensors(whole), cache_tensors(cache)))


@pytest.mark.parametrize("arch", ["qwen3_5", "mamba2", "qwen3"])
def test_multi_turn_chats_with_kv_sharing_on_and_off_equal_cache_off(make_service, arch):
    """The engine's own checkpoints (system prompt, history, reply) along six turns with two system prompts:
    shared KV, whole KV and no cache give the same tokens; sharing holds fewer bytes for the same hits."""
    from .test_engine_cache import run_chat

    shared, whole = make_service(arch), make_service(arch, kv_sharing=False)
    got, whole_got = run_chat(shared), run_chat(whole)
    want = run_chat(make_service(arch, cache_enabled=False))
    assert [g[0] for g in got] == [w[0] for w in whole_got] == [w[0] for w in want]
    assert [g[1] for g in got] == [w[1] for w in whole_got] and sum(g[1] for g in got) > 0
    snaps = [s for _, s in shared.cache.tree.snapshots()]
    if arch in KV_FREE:
        assert all(s.kv is None for s in snaps) and shared.cache.tree.kv_bytes == 0
        return
    assert sum(s.kv.parent is not None for s in snaps) >= 3  # the checkpoints of each conversation chain
    assert all(s.kv.parent is None for _, s in whole.cache.tree.snapshots())
    assert shared.cache.tree.kv_bytes < whole.cache.tree.kv_bytes
    assert shared.cache.tree.state_bytes == whole.cache.tree.state_bytes


def _one_layer_cache(keys, values):
    cache = DynamicCache()
    cache.layers = [DynamicLayer()]
    cache.layers[0].lazy_initialization(keys[..., :0, :], values[..., :0, :])
    cache.layers[0].keys, cache.layers[0].values = keys, values
    return cache


def test_a_chain_stops_growing_at_max_chain_and_joins_at_any_cut(monkeypatch):
    monkeypatch.setattr(kv_chain, "MAX_CHAIN", 3)
    keys, values = torch.randn(1, 2, 12, 4), torch.randn(1, 2, 12, 4)
    snap = None
    for end in range(2, 13, 2):
        cache = _one_layer_cache(keys[..., :end, :], values[..., :end, :])
        snap = kv_chain.split(cache, end, "h", snap.kv if snap is not None else None)
        assert snap.kv.depth == (end // 2 - 1) % 3 + 1  # a fourth segment starts a new chain of one
    assert [(seg.start, seg.end) for seg in snap.kv.chain()] == [(0, 8), (8, 10), (10, 12)]
    for cut in range(1, 13):
        k, v = kv_chain.assemble(snap.kv, cut)[0]
        assert torch.equal(k, keys[..., :cut, :]) and torch.equal(v, values[..., :cut, :])
    with pytest.raises(kv_chain.KVChainError):
        kv_chain.assemble(snap.kv, 13)

"""Batched decode keeps its batched cache between steps; every row still equals decoding alone."""

import pytest
import torch

import hyserve.state.decode_batch as batching
from hyserve.state import batch_layers

from .test_state import _ids


def _solo(ad, prompt):
    st = ad.new_state()
    return st, ad.forward(st, prompt)


class _Requests:
    """Requests of the given prompt lengths, each decoded both through batched passes (`batched`) and alone
    (`solo`); `gathers` counts the batches gathered afresh."""

    def __init__(self, runtimes, arch, lengths, monkeypatch):
        self.arch, self.ad, self.gathers = arch, runtimes(arch).adapter, []
        real_gather = batching.gather
        monkeypatch.setattr(batching, "gather", lambda *a: self.gathers.append(1) or real_gather(*a))
        prompts = [_ids(runtimes(arch), n, seed=n) for n in lengths]
        self.batched = [_solo(self.ad, p)[0] for p in prompts]
        self.solo = [_solo(self.ad, p)[0] for p in prompts]

    def step(self, members, toks=None, room=0):
        """One batched pass over `members` (indices), `room` more requests about to join; every row must equal
        decoding alone. Returns the batch's width."""
        if toks is None:
            toks = [3 + (7 * i + len(self.solo[i].tokens)) % 50 for i in members]
        got = self.ad.forward_batch([self.batched[i] for i in members], toks, room=room)
        for row, (i, t) in enumerate(zip(members, toks)):
            want = self.ad.forward(self.solo[i], [t])
            assert torch.allclose(got[row], want, atol=1e-4), (self.arch, members, row)
            assert self.batched[i].tokens == self.solo[i].tokens
        return self.ad._batch.width


@pytest.mark.parametrize("arch", ["qwen3_5", "mamba2", "qwen3"])
def test_persistent_batch_equals_solo_decode(runtimes, arch, monkeypatch):
    monkeypatch.setattr(batch_layers, "SPARE", 2)  # the batch KV fills its spare columns and grows mid-test
    r = _Requests(runtimes, arch, (9, 17, 30), monkeypatch)
    ad, gathers, batched, solo, step = r.ad, r.gathers, r.batched, r.solo, r.step
    for k in range(4):  # the same three rows: gathered once, then reused
        step([0, 1, 2], [5 + k, 6 + k, 7 + k])
    assert len(gathers) == 1
    ad.forward(batched[1], [11, 12])  # a per-request pass (as speculation does) takes row 1 out...
    ad.forward(solo[1], [11, 12])
    step([0, 1, 2], [3, 4, 5])
    assert len(gathers) == 1  # ...and its state is copied back into a free row: no gathering
    step([0, 2], [8, 9])  # a request left: one row of three would idle, gathered afresh
    step([0, 2], [10, 11])
    assert len(gathers) == 2
    # a state that views the batch snapshots to its own size only, and restores to an equal state
    snap, ref = ad.snapshot(batched[0]), ad.snapshot(solo[0])
    assert snap.nbytes == ref.nbytes and snap.prefix_hash == ref.prefix_hash
    a, b = ad.restore(snap, batched[0].tokens), ad.restore(ref, solo[0].tokens)
    assert torch.allclose(ad.forward(a, [13]), ad.forward(b, [13]), atol=1e-4)


@pytest.mark.parametrize("arch", ["qwen3_5", "mamba2", "qwen3"])
def test_requests_join_and_leave_without_gathering_everyone(runtimes, arch, monkeypatch):
    """A request that finishes (its state is gone) frees its row; one that joins takes a free row when its KV
    fits; every row still equals decoding alone, whatever the free rows hold. Gathered afresh when a
    joiner is longer than the batch, when too many rows would idle, or when a live state sits a pass out
    (the pass would overwrite the conv and recurrent states it views)."""
    r = _Requests(runtimes, arch, (9, 17, 30, 12, 21, 14, 60, 10), monkeypatch)
    ad, gathers, batched, solo, step = r.ad, r.gathers, r.batched, r.solo, r.step
    step([0, 1, 2, 3, 4])
    batched[4] = None  # request 4 finished: its state is gone
    step([0, 1, 2, 3])  # its row idles (one of four may)
    batched[1] = None
    step([0, 5, 2, 3])  # 1 finished, 5 joins into a free row
    step([3, 0, 2, 5])  # same requests, another order
    assert len(gathers) == 1
    ad.forward(batched[3], [4, 5, 6])  # a pass of its own takes 3 out; it comes back into its own row
    ad.forward(solo[3], [4, 5, 6])
    step([3, 0, 2, 5])
    assert len(gathers) == 1
    step([3, 2, 5, 7])  # 0 sits this pass out, alive: gathered afresh, its rows left as they are
    assert len(gathers) == 2
    step([0, 3, 2, 5, 7])  # ...and 0, untouched, decodes on (joining through a fresh gather)
    step([0, 2, 6])  # 6 has more tokens than the batch is wide: gathered afresh
    step([0, 2, 6])
    assert len(gathers) == 4


@pytest.mark.parametrize("arch", ["qwen3_5", "mamba2", "qwen3"])
def test_a_batch_keeps_free_rows_for_requests_still_in_prefill(runtimes, arch, monkeypatch):
    """Requests that start together finish their prefills a few at a time. A batch gathered while others are
    still in prefill keeps free rows for them (zero states, all padding), and each joins into one: no
    gathering of everyone per join, and every row still equals decoding alone."""
    r = _Requests(runtimes, arch, (20, 24, 22, 21, 26), monkeypatch)
    gathers, step = r.gathers, r.step
    r.ad.drop_batch()  # (as the engine does when nothing runs) not an earlier test's batch
    step([0, 1], room=3)  # two decode, three still prefill: rows for all five
    assert len(r.ad._batch.owners) == 5
    step([0, 1, 2, 3], room=1)
    step([0, 1, 2, 3, 4])
    step([0, 1, 2, 3, 4])
    assert len(gathers) == 1
    step([0, 1], room=0)  # three finished... alive: gathered afresh
    assert len(gathers) == 2 and len(r.ad._batch.owners) == 2


def test_a_finished_batch_is_freed_without_the_cycle_collector(runtimes):
    """States and batches must not reference each other: a cycle would keep every old batch's buffers
    (tens of MB under load) alive until a full garbage collection, which may not come for minutes."""
    import gc
    import weakref

    ad = runtimes("qwen3_5").adapter
    states = [_solo(ad, _ids(runtimes("qwen3_5"), n, seed=n))[0] for n in (5, 8)]
    gc.disable()
    try:
        ad.forward_batch(states, [3, 4])
        ad.forward_batch(states, [5, 6])
        buffers = [
            weakref.ref(t)
            for layer in ad._batch.cache.layers
            for t in ([layer._k] if isinstance(layer, batch_layers.GrowingLayer) else layer.recurrent_states.values())
            if t is not None
        ]
        assert buffers
        del states
        ad._batch = None  # what the next batch of other requests does
        assert all(ref() is None for ref in buffers)
    finally:
        gc.enable()


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3"])
def test_the_batch_narrows_when_only_finished_requests_used_its_left_columns(runtimes, arch, monkeypatch):
    """Rows are right-aligned at the batch's width, which grows by a column every pass. When the long request
    finishes and short ones keep taking its row, the batch is gathered afresh, narrower, instead of keeping
    (and attending over) columns nobody uses; every row still equals decoding alone."""
    monkeypatch.setattr(batch_layers, "SPARE", 2)
    r = _Requests(runtimes, arch, (60, 9, 12, 10, 14), monkeypatch)
    ad, gathers, batched, step = r.ad, r.gathers, r.batched, r.step
    assert step([0, 1, 2, 3]) == 61
    batched[0] = None  # the long request finished; a short one takes its row
    step([4, 1, 2, 3])
    assert len(gathers) == 2  # 61 columns for requests of at most 15 tokens: gathered afresh
    assert ad._batch.width == max(len(s.tokens) for s in batched[1:])
    for _ in range(3):
        step([4, 1, 2, 3])
    assert len(gathers) == 2  # and then reused

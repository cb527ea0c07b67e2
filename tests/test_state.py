"""State interface per family: split prefill through snapshot/restore equals one prefill, exactly."""

import pytest
import torch

from hyserve.families import UnsupportedModelError
from hyserve.models.runtime import ModelRuntime
from hyserve.state.snapshot import token_hash

from .conftest import FAMILIES


def _ids(rt, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, len(rt.tokenizer), (n,), generator=g).tolist()


def _greedy(adapter, state, logits, n):
    out = []
    for _ in range(n):
        tok = int(torch.argmax(logits))
        out.append(tok)
        logits = adapter.forward(state, [tok])
    return out


@pytest.mark.parametrize("arch", FAMILIES)
def test_split_prefill_through_snapshot_equals_full_prefill(runtimes, arch):
    rt = runtimes(arch)
    ad = rt.adapter
    ids = _ids(rt, 40)
    full = ad.new_state()
    ref_logits = ad.forward(full, ids)
    ref_cont = _greedy(ad, full, ref_logits, 12)

    part = ad.new_state()
    ad.forward(part, ids[:25])
    snap = ad.snapshot(part)
    assert snap.num_tokens == 25 and snap.prefix_hash == token_hash(ids[:25]) and snap.nbytes > 0
    for _ in range(2):  # the snapshot stays pristine: restoring twice gives the same result
        live = ad.restore(snap, ids[:25])
        logits = ad.forward(live, ids[25:])
        torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-5)
        assert _greedy(ad, live, logits, 12) == ref_cont
    assert snap.num_tokens == 25


@pytest.mark.parametrize("arch", FAMILIES)
def test_snapshot_is_a_copy_not_a_view(runtimes, arch):
    rt = runtimes(arch)
    ad = rt.adapter
    ids = _ids(rt, 20, seed=1)
    live = ad.new_state()
    ad.forward(live, ids)
    snap = ad.snapshot(live)
    before = [t.clone() for t in _snapshot_tensors(snap)]
    ad.forward(live, ids[:7])  # advancing the live state must not change the snapshot
    assert all(torch.equal(a, b) for a, b in zip(before, _snapshot_tensors(snap)))


@pytest.mark.parametrize("arch", FAMILIES)
def test_a_restored_state_never_writes_into_its_snapshot(runtimes, arch):
    """restore shares the snapshot's attention KV; nothing a live state goes through may write into it."""
    from hyserve import model_thread

    rt = runtimes(arch)
    ad = rt.adapter
    ids = _ids(rt, 30, seed=4)

    def scenario():
        live = ad.new_state()
        ad.forward(live, ids[:20])
        snap = ad.snapshot(live)
        before = [t.clone() for t in _snapshot_tensors(snap)]
        a, b = ad.restore(snap, ids[:20]), ad.restore(snap, ids[:20])
        ad.forward(a, ids[20:25])  # a prefill piece
        for tok in (5, 6, 7):  # batched decode, rows of different lengths
            ad.forward_batch([a, b], [tok, tok])
        point = ad.rollback_point(b)
        ad.forward(b, ids[25:29])
        ad.rewind(b, point, ids[25:27])
        ad.snapshot(a)
        c = ad.restore(snap, ids[:20])
        if ad.can_truncate(c):
            ad.truncate(c, 10)
            ad.forward(c, ids[10:14])
        ad.forward_batch([c], [8])
        ad.drop_batch()
        return before, snap

    before, snap = model_thread.run(scenario)
    assert all(torch.equal(x, y) for x, y in zip(before, _snapshot_tensors(snap)))


@pytest.mark.parametrize("arch", FAMILIES)
def test_snapshot_tensors_share_one_block_of_their_own(runtimes, arch):
    """A snapshot's state part and its KV segment are compact copies, each in one mapped block of its own
    (outside the heap), counted once."""
    import gc
    import sys

    from hyserve.state.caches import cache_nbytes
    from hyserve.state.kv_chain import standalone

    rt = runtimes(arch)
    ad = rt.adapter
    live = ad.new_state()
    ad.forward(live, _ids(rt, 21, seed=2))
    snap = ad.snapshot(live)
    assert (snap.kv is not None) == (arch != "mamba2") and (snap.kv is None or snap.kv.chain() == [snap.kv])
    groups = [g for g in (_tensors(snap.cache), _segment_tensors(snap.kv)) if g]
    for copies in groups:
        assert len({t.untyped_storage().data_ptr() for t in copies}) == 1
        assert all(c.is_contiguous() and c.data_ptr() % 64 == 0 for c in copies)
    assert all(torch.equal(c, o) for c, o in zip(_tensors(standalone(snap)), _tensors(live.cache)))
    copies = [t for g in groups for t in g]
    exact = sum(t.numel() * t.element_size() for t in copies)
    assert exact <= snap.nbytes == cache_nbytes(snap.cache) + snap.kv_nbytes < exact + 64 * len(copies)
    ptrs = [g[0].untyped_storage().data_ptr() for g in groups]
    if sys.platform.startswith("linux"):  # each block is a mapping of its own, unmapped with the snapshot
        assert all(_mapping_of(p) is not None for p in ptrs)
        del snap, copies, groups
        gc.collect()
        assert all(_mapping_of(p) is None for p in ptrs)


def _mapping_of(address: int):
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= address < hi:
                return lo, hi
    return None


def test_packed_clones_of_mixed_dtypes_and_views():
    from hyserve.state.caches import packed_clones

    base = torch.arange(60, dtype=torch.float32).view(6, 10)
    tensors = [
        base[1:4, ::3],
        torch.tensor([True, False, True]),
        torch.arange(5, dtype=torch.int64),
        torch.empty(0),
        base.t(),
    ]
    copies = packed_clones(tensors)
    for t, c in zip(tensors, copies):
        assert c.dtype == t.dtype and c.shape == t.shape and c.is_contiguous() and torch.equal(c, t)
    base.zero_()
    assert copies[0].sum() > 0  # copies, not views


def _tensors(cache):
    from hyserve.state.caches import cache_tensors

    return list(cache_tensors(cache))


def _segment_tensors(segment):
    """The tensors of a KV chain ending in `segment` (none for None)."""
    chain = segment.chain() if segment is not None else []
    return [t for seg in chain for pair in seg.layers if pair is not None for t in pair]


def _snapshot_tensors(snap):
    """Everything a snapshot holds: its state part's tensors and its KV chain's."""
    return _tensors(snap.cache) + _segment_tensors(snap.kv)


def test_truncate_attention_only(runtimes):
    rt = runtimes("qwen3")
    ad = rt.adapter
    ids = _ids(rt, 40, seed=2)
    ref = ad.forward(ad.new_state(), ids)
    other = _ids(rt, 15, seed=3)
    live = ad.new_state()
    ad.forward(live, ids[:25] + other)
    assert ad.can_truncate(live)
    ad.truncate(live, 25)
    assert live.position == 25 and ad.attention_length(live) == 25
    torch.testing.assert_close(ad.forward(live, ids[25:]), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_next", "mamba2"])
def test_recurrent_states_refuse_truncation(runtimes, arch):
    rt = runtimes(arch)
    live = rt.adapter.new_state()
    rt.adapter.forward(live, _ids(rt, 10))
    assert not rt.adapter.can_truncate(live)
    with pytest.raises(ValueError):
        rt.adapter.truncate(live, 5)


def test_unknown_model_type_names_supported(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "gpt_bigcode"}')
    with pytest.raises(UnsupportedModelError, match="qwen3_5.*mamba2"):
        ModelRuntime.load(tmp_path)


def test_not_a_model_directory(tmp_path):
    with pytest.raises(FileNotFoundError):
        ModelRuntime.load(tmp_path)


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_next"])
@pytest.mark.parametrize("start,offsets", [(0, [2, 9]), (17, [5, 21, 29])])
def test_states_captured_inside_a_piece_equal_split_prefills(runtimes, arch, start, offsets):
    """A checkpoint inside a prefill piece (hyserve's kernels hand out the state there) equals the state of a
    prefill split at that token, and continues exactly like it; the piece itself runs as without capture.
    Offset 2 is shorter than the conv kernel (4): its conv state is zero-padded, as transformers pads it."""
    from hyserve import model_thread
    from hyserve.state.kv_chain import standalone

    rt = runtimes(arch)
    ad = rt.adapter
    ids = _ids(rt, start + 40, seed=3)
    piece = ids[start : start + 30]

    def run():
        assert ad.can_capture()
        live, plain = ad.new_state(), ad.new_state()
        for st in (live, plain):
            if start:
                ad.forward(st, ids[:start])
        logits, captured = ad.forward_capturing(live, piece, offsets)
        torch.testing.assert_close(logits, ad.forward(plain, piece), atol=1e-5, rtol=1e-5)
        assert captured is not None and [c.position for c in captured] == [start + o for o in offsets]
        for o, got in zip(offsets, captured):
            split = ad.new_state()
            if start:
                ad.forward(split, ids[:start])
            ad.forward(split, piece[:o])
            assert got.tokens == split.tokens
            snap, want = ad.snapshot(got), ad.snapshot(split)
            assert snap.nbytes == want.nbytes
            for a, b in zip(_tensors(standalone(snap)), _tensors(standalone(want))):
                torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
            a, b = ad.restore(snap, got.tokens), ad.restore(want, split.tokens)
            rest = ids[start + o :]
            la, lb = ad.forward(a, rest), ad.forward(b, rest)
            torch.testing.assert_close(la, lb, atol=1e-5, rtol=1e-5)
            assert _greedy(ad, a, la, 6) == _greedy(ad, b, lb, 6)

    model_thread.run(run)
    assert not ad.can_capture()  # off the model thread transformers' own kernels run: nothing to capture


@pytest.mark.parametrize("arch", ["mamba2", "qwen3"])
def test_other_families_split_the_prefill_instead(runtimes, arch):
    from hyserve import model_thread

    assert not model_thread.run(runtimes(arch).adapter.can_capture)

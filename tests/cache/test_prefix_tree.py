"""The radix tree of checkpoints: deepest exact match, truncation lookup, dedupe, budget, pins."""

from hyserve.cache.prefix_tree import PrefixTree
from hyserve.state.snapshot import Snapshot, token_hash


def snap(tokens, nbytes=10):
    return Snapshot(cache=None, num_tokens=len(tokens), prefix_hash=token_hash(tokens), nbytes=nbytes)


def test_deepest_exact_prefix_wins():
    t = PrefixTree(1000)
    a, b = [1, 2, 3], [1, 2, 3, 4, 5]
    t.insert(a, snap(a))
    t.insert(b, snap(b))
    m = t.lookup([1, 2, 3, 4, 5, 6, 7], max_length=6, truncate=False)
    assert m.length == 5 and m.snapshot.num_tokens == 5
    m = t.lookup([1, 2, 3, 4, 9], max_length=4, truncate=False)
    assert m.length == 3
    assert t.lookup([2, 3], max_length=1, truncate=False) is None


def test_max_length_caps_the_match():
    t = PrefixTree(1000)
    a = [1, 2, 3, 4]
    t.insert(a, snap(a))
    assert t.lookup(a, max_length=3, truncate=False) is None  # never the whole prompt
    assert t.lookup(a, max_length=3, truncate=True).length == 3


def test_truncate_mode_uses_a_deeper_snapshot_cut_back():
    t = PrefixTree(1000)
    a = [1, 2, 3, 4, 5, 6]
    t.insert(a, snap(a))
    m = t.lookup([1, 2, 3, 9, 9], max_length=4, truncate=True)
    assert m.length == 3 and m.needs_truncation and m.snapshot.num_tokens == 6
    assert t.lookup([1, 2, 3, 9, 9], max_length=4, truncate=False) is None


def test_edge_split_keeps_both_branches():
    t = PrefixTree(1000)
    a, b = [1, 2, 3, 4], [1, 2, 7, 8]
    t.insert(a, snap(a))
    t.insert(b, snap(b))
    assert t.has(a) and t.has(b) and not t.has([1, 2])
    assert t.lookup(b + [0], 5, False).snapshot.num_tokens == 4
    assert t.lookup(a + [0], 5, False).snapshot.prefix_hash == token_hash(a)


def test_duplicates_are_not_stored_twice():
    t = PrefixTree(1000)
    a = [5, 6, 7]
    assert t.insert(a, snap(a))[:2] == (True, "recorded")
    assert t.insert(a, snap(a))[:2] == (False, "duplicate")
    assert t.entries == 1 and t.total_bytes == 10


def test_token_count_mismatch_is_refused():
    t = PrefixTree(1000)
    assert t.insert([1, 2], snap([1, 2, 3]))[:2] == (False, "token_count_mismatch")


def test_lru_eviction_keeps_bytes_under_budget_and_prefers_leaves():
    t = PrefixTree(30)
    sys_ = [1, 2]
    t.insert(sys_, snap(sys_))
    t.insert([1, 2, 3], snap([1, 2, 3]))
    t.insert([1, 2, 4], snap([1, 2, 4]))
    t.lookup([1, 2, 3, 0], 4, False)  # touch [1,2,3]
    stored, _, evicted = t.insert([1, 2, 5], snap([1, 2, 5]))
    assert stored and t.total_bytes <= 30
    assert [e.num_tokens for e in evicted] == [3] and not t.has([1, 2, 4])
    assert t.has(sys_)  # the shared inner prefix outlives leaves


def test_pinned_snapshots_are_not_evicted():
    t = PrefixTree(20)
    a, b, c = [1], [2], [3]
    t.insert(a, snap(a))
    t.insert(b, snap(b))
    m = t.lookup([1, 0], 1, False)
    t.pin(m.node)
    t.lookup([2, 0], 1, False)  # b is now more recent, but a is pinned
    t.insert(c, snap(c))
    assert t.has(a) and not t.has(b) and t.has(c)
    t.unpin(m.node)


def test_over_budget_snapshot_is_declined_and_remove_prunes():
    t = PrefixTree(5)
    assert t.insert([1], snap([1], nbytes=6))[:2] == (False, "over_budget")
    t.budget_bytes = 100
    t.insert([1, 2, 3], snap([1, 2, 3]))
    node = t.lookup([1, 2, 3, 4], 4, False).node
    t.remove(node)
    assert t.entries == 0 and t.total_bytes == 0 and not t.root.children


def test_a_tenant_clear_drops_only_that_tenants_salts():
    from hyserve.cache.namespace import make_salt

    t = PrefixTree(1000)
    a, a_proj, b, keyless = make_salt("ta", None), make_salt("ta", "proj"), make_salt("tb", None), make_salt("", "x")
    for salt in (a, a_proj, b, keyless):
        t.insert([1, 2, 3], snap([1, 2, 3]), salt)
    t.insert([1, 2], snap([1, 2]), a)
    node = t.lookup([1, 2, 3, 4], 4, False, salt=a_proj).node
    t.pin(node)  # in use by a running request: dead, found by nothing, dropped when it is unpinned
    assert t.usage("ta") == (3, 30) and t.usage(None) == (5, 50)
    assert t.clear("ta") == 3
    assert t.usage("ta") == (0, 0) and not t.has([1, 2, 3], a_proj) and not t.has([1, 2, 3], a)
    assert t.lookup([1, 2, 3, 4], 4, False, a_proj) is None and t.lookup([1, 2, 3, 4], 4, True, a_proj) is None
    assert t.base_for([1, 2, 3, 4], a_proj) is None and not list(t.snapshots())[2:]
    assert t.has([1, 2, 3], b) and t.has([1, 2, 3], keyless) and t.usage("") == (1, 10)
    assert t.entries == 3 and t.total_bytes == 30 and a not in t.roots  # an emptied salt keeps no root
    assert t.usage() == (2, 20) and t.total_bytes == 30  # no one's; memory holds its bytes until it is unpinned
    t.unpin(node)
    assert t.entries == 2 and t.dead == 0 and t.usage() == (2, 20) and not t.roots[a_proj].children
    assert t.clear() == 2 and t.entries == 0


def test_a_dead_checkpoint_recorded_again_takes_the_new_snapshot():
    t = PrefixTree(1000)
    t.insert([1, 2], snap([1, 2]), "s")
    node = t.lookup([1, 2, 3], 3, False, salt="s").node
    t.pin(node)
    t.clear()
    fresh = snap([1, 2], nbytes=7)
    assert t.insert([1, 2], fresh, "s")[:2] == (True, "recorded")
    assert (t.entries, t.dead, t.total_bytes) == (1, 0, 7) and t.lookup([1, 2, 3], 3, False, salt="s").snapshot is fresh
    t.unpin(node)  # the holder of the old one ends: the new one stays
    assert t.has([1, 2], "s") and t.entries == 1

"""The routing policy and what replicas publish, without Ray: exact keys, deepest holder, load, memory."""

import pytest

from hyserve.cache.prefix_tree import PrefixTree
from hyserve.scale.publish import Published, checkpoint_key, prefix_keys
from hyserve.scale.router import CheckpointRouting, RoutingTelemetry
from hyserve.state.snapshot import Snapshot, token_hash


def snap(tokens, nbytes=100):
    return Snapshot(None, len(tokens), token_hash(tokens), nbytes)


def test_prefix_keys_are_the_salted_snapshot_hashes():
    tokens = list(range(1000, 1300))
    keys = prefix_keys("t:s", tokens, [1, 17, 300, 301])
    assert set(keys) == {1, 17, 300}  # a length past the prompt has no key
    for n, key in keys.items():
        assert key == checkpoint_key("t:s", token_hash(tokens[:n]))
    assert prefix_keys("other", tokens, [17])[17] != keys[17]  # one tenant's keys never match another's


def test_published_follows_the_tree_through_records_evictions_and_clears():
    tree, pub = PrefixTree(budget_bytes=250), Published()
    a, b, c = [1, 2, 3], [1, 2, 3, 4, 5], [9, 9]
    tree.insert(a, snap(a), "")
    pub.attach(tree)  # what the tree already holds is published too
    tree.insert(b, snap(b), "s")
    assert dict(pub.checkpoints()) == {checkpoint_key("", token_hash(a)): 3, checkpoint_key("s", token_hash(b)): 5}
    tree.insert(c, snap(c), "")  # over budget: the least recently used (a) is evicted
    held = dict(pub.checkpoints())
    assert checkpoint_key("", token_hash(a)) not in held and checkpoint_key("", token_hash(c)) in held
    tree.clear()
    assert pub.checkpoints() == []


def route_policy(**published):
    policy = CheckpointRouting(imbalance=2)
    for replica, held in published.items():
        policy.update(replica, held)
    return policy


def held(salt, tokens, *lengths):
    return [(checkpoint_key(salt, token_hash(tokens[:n])), n) for n in lengths]


PROMPT = list(range(100))


def test_the_deepest_exact_checkpoint_wins():
    policy = route_policy(a=held("", PROMPT, 10), b=held("", PROMPT, 10, 60), c=[])
    route = policy.choose("", PROMPT, {"a": 0, "b": 1, "c": 0})
    assert (route.replica, route.reason, route.depth) == ("b", "checkpoint", 60)
    assert route.depths == {"a": 10, "b": 60, "c": 0}


def test_only_exact_prefixes_count():
    other = PROMPT[:50] + [7] * 50  # shares 50 tokens, but b's checkpoint at 60 is of another text
    policy = route_policy(a=held("", PROMPT, 20), b=held("", other, 60))
    assert policy.choose("", PROMPT, {"a": 1, "b": 0}).replica == "a"
    # the whole prompt is never a usable checkpoint (the last token must run): length 100 is ignored
    policy = route_policy(a=held("", PROMPT, 100), b=held("", PROMPT, 30))
    assert policy.choose("", PROMPT, {"a": 0, "b": 0}).replica == "b"


def test_other_tenants_checkpoints_do_not_attract():
    policy = route_policy(a=held("tenant-1:", PROMPT, 60))
    route = policy.choose("tenant-2:", PROMPT, {"a": 3, "b": 0})
    assert (route.replica, route.reason, route.depth) == ("b", "load", 0)


def test_an_overloaded_holder_is_passed_over():
    policy = route_policy(a=held("", PROMPT, 60), b=held("", PROMPT, 10))
    route = policy.choose("", PROMPT, {"a": 5, "b": 3, "c": 2})  # a: 3 above the least loaded (imbalance 2)
    assert (route.replica, route.reason, route.depth, route.overloaded) == ("b", "checkpoint", 10, "a")
    route = policy.choose("", PROMPT, {"a": 5, "b": 5, "c": 0})  # every holder overloaded: least loaded
    assert (route.replica, route.reason, route.overloaded) == ("c", "load", "a")


def test_no_checkpoint_anywhere_goes_to_the_least_loaded():
    policy = route_policy(a=[], b=[])
    assert policy.choose("", PROMPT, {"a": 2, "b": 1}).replica == "b"
    assert policy.choose("", None, {"a": 0, "b": 1}).replica == "a"  # nothing to route by (not a prompt)
    with pytest.raises(ValueError):
        policy.choose("", PROMPT, {})


def test_new_conversations_arriving_one_at_a_time_take_turns_across_equally_loaded_replicas():
    policy = route_policy(a=[], b=[], c=[])
    picks = []
    for i in range(6):
        route = policy.choose("", [i] * 10, {"a": 0, "b": 0, "c": 0})
        picks.append(route.replica)
        policy.sent(route.replica)
    assert picks == ["a", "b", "c", "a", "b", "c"]
    # chosen together, before Ray reports any of them as sent: they take turns as well
    assert [policy.choose("", [i] * 10, {"a": 0, "b": 0, "c": 0}).replica for i in range(3)] == ["a", "b", "c"]
    policy.sent("a")  # where a request actually went counts (Ray may send it to its next rank)
    assert policy.choose("", None, {"a": 0, "b": 0, "c": 0}).replica == "b"
    assert policy.choose("", None, {"a": 0, "b": 1, "c": 1}).replica == "a"  # load comes first
    policy.drop("c")
    assert policy.choose("", None, {"a": 0, "b": 0, "c": 0}).replica == "c"  # a replica that is back starts afresh


def test_the_next_turn_follows_its_conversation_before_anything_is_published():
    policy = route_policy(a=[], b=[])
    turn1 = list(range(40))
    first = policy.choose("s", turn1, {"a": 0, "b": 0})
    policy.remember(first.replica, "s", turn1)
    turn2 = turn1 + [5, 6, 7, 8]
    other = "b" if first.replica == "a" else "a"
    route = policy.choose("s", turn2, {first.replica: 1, other: 0})  # busier, still within the imbalance
    assert (route.replica, route.reason, route.depth) == (first.replica, "checkpoint", 40)
    policy.drop(first.replica)  # the replica is gone: its remembered routes go with it
    assert policy.choose("s", turn2, {other: 0}).depth == 0


def test_each_decision_is_a_metric_and_an_event():
    telemetry = RoutingTelemetry()
    policy = route_policy(a=held("", PROMPT, 60), b=[])
    telemetry.decided(policy.choose("", PROMPT, {"a": 0, "b": 0}), "a", "r1", len(PROMPT))
    telemetry.decided(policy.choose("", PROMPT, {"a": 0, "b": 0}), "b", "r2", len(PROMPT))  # Ray sent it elsewhere
    events = telemetry.events()
    assert [(e["reason"], e["replica"], e["checkpoint_tokens"]) for e in events] == [
        ("checkpoint", "a", 60),
        ("load", "b", 0),
    ]
    assert events[1]["deepest_elsewhere"] == 60
    value = telemetry.registry.get_sample_value
    assert value("hyserve_route_requests_total", {"reason": "checkpoint"}) == 1
    assert value("hyserve_route_requests_total", {"reason": "load"}) == 1
    assert value("hyserve_route_checkpoint_tokens_sum") == 60


def test_a_request_sent_away_from_its_overloaded_holder_is_never_offered_back_to_it():
    """Ray Serve tries the ranks `choose_replicas` returns in order and moves on when a replica's queue-length
    probe fails (a busy machine): the overloaded holder must not be among them, or the request lands there."""
    import asyncio
    from types import SimpleNamespace

    pytest.importorskip("ray.serve")
    from hyserve.scale.request_router import CheckpointRequestRouter
    from hyserve.scale.routed import Routed

    router = object.__new__(CheckpointRequestRouter)  # its state only: no Ray controller here
    router.initialize_state(imbalance=4)
    for name, lengths in (("a", (60,)), ("b", ()), ("c", ())):
        router.policy.update(name, held("", PROMPT, *lengths))
    replicas = [SimpleNamespace(replica_id=SimpleNamespace(unique_id=n)) for n in "abc"]

    def ranks(inflight):
        router.inflight.clear()
        router.inflight.update(inflight)
        pending = SimpleNamespace(args=[Routed("r", "", PROMPT)], metadata=SimpleNamespace(internal_request_id="i"))
        got = asyncio.run(router.choose_replicas(replicas, pending))
        return [[r.replica_id.unique_id for r in rank] for rank in got]

    assert ranks({"a": 6, "b": 0, "c": 1}) == [["b"], ["c"]]  # a overloaded: b, then c, never a
    assert ranks({"a": 2, "b": 0, "c": 1}) == [["a"], ["b", "c"]]  # within the imbalance: the holder first

"""Checkpoint boundaries are strict token prefixes of the prompt; failures skip, never break."""

from hyserve.cache.policy import CheckpointPolicy


def prefill_boundaries(policy, prompt, messages, render, recurrent):
    """The policy's two steps as the engine runs them: the wanted renders, then the prefix checks."""
    wanted = policy.wanted_renders(messages, recurrent)
    rendered = []
    for _, msgs in wanted:
        try:
            rendered.append(render(msgs, False))
        except Exception as exc:
            rendered.append(exc)
    return policy.boundaries_from(prompt, wanted, rendered)


def test_history_and_system_boundaries_are_prefixes(runtimes):
    rt = runtimes("qwen3_5")
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi there"}]
    prompt = rt.render_chat(msgs, True)
    bounds, skipped = prefill_boundaries(CheckpointPolicy(), prompt, msgs, rt.render_chat, recurrent=True)
    assert [b.kind for b in bounds] == ["system", "history"] and not skipped
    for b in bounds:
        assert 0 < b.length < len(prompt)
    assert bounds[1].length == len(rt.render_chat(msgs, False))


def test_not_a_prefix_is_skipped():
    prompt = [1, 2, 3, 4]
    bounds, skipped = prefill_boundaries(
        CheckpointPolicy(), prompt, [{"role": "user", "content": "x"}], lambda m, g: [1, 9], recurrent=True
    )
    assert bounds == [] and skipped == ["history:not_a_prefix@1"]  # where the render departs


def test_render_failure_is_skipped():
    def boom(m, g):
        raise ValueError("template")

    bounds, skipped = prefill_boundaries(CheckpointPolicy(), [1, 2], [{"role": "user", "content": "x"}], boom, True)
    assert bounds == [] and skipped[0].startswith("history:render_failed")


def test_attention_only_models_need_no_prefill_boundaries(runtimes):
    rt = runtimes("qwen3")
    msgs = [{"role": "user", "content": "Hi"}]
    assert prefill_boundaries(CheckpointPolicy(), rt.render_chat(msgs, True), msgs, rt.render_chat, False) == ([], [])


def test_block_grid_baseline():
    bounds, _ = prefill_boundaries(CheckpointPolicy(block_size=4), list(range(10)), None, None, True)
    assert [b.length for b in bounds] == [4, 8]


def test_post_decode_rerender_check():
    pol = CheckpointPolicy()
    seen = []
    render = lambda msgs: seen.append(msgs) or [1, 2, 3, 4, 5]  # noqa: E731
    msgs = [{"role": "user", "content": "x"}]
    reply = {"role": "assistant", "content": "r"}
    assert pol.post_decode_ok([1, 2, 3], msgs, reply, render) == (True, "rerender_match", [1, 2, 3, 4, 5])
    assert seen[-1] == msgs + [reply]  # the history the next turn sends: this turn's messages and the reply
    # a mismatch on a recurrent model: drop the state, rebuild the next turn's history instead
    assert pol.post_decode_ok([1, 2, 7], msgs, reply, render) == (False, "rerender_mismatch@2", [1, 2, 3, 4, 5])
    assert pol.post_decode_ok([1, 2, 7], msgs, reply, render, recurrent=False) == (
        True,
        "rerender_mismatch@2",
        [1, 2, 3, 4, 5],
    )  # attention KV still truncates to the shared part
    assert pol.post_decode_ok([1, 2, 3, 4, 5, 6], msgs, reply, render)[1] == "rerender_mismatch@5"  # longer
    assert CheckpointPolicy(reply_rerender=False).post_decode_ok([1, 2, 7], msgs, reply, render)[2] is None
    assert pol.post_decode_ok([1], None, reply, render) == (True, "completion", None)
    assert CheckpointPolicy(post_decode=False).post_decode_ok([1], None, reply, render)[0] is False


def test_short_tail_boundaries_near_the_restored_state_are_deferred_when_asked():
    from hyserve.cache.policy import DEFER_TAIL, Boundary

    assert CheckpointPolicy().split_now(Boundary(4258, "history"), 4182, 4261)  # default: never deferred
    pol = CheckpointPolicy(defer_tail=DEFER_TAIL)  # --defer-checkpoints: defer_tail 16, defer_redo 512
    history = Boundary(4258, "history")
    assert not pol.split_now(history, checkpoint=4182, prompt_length=4261)  # warm turn: 3-token tail
    assert pol.split_now(history, checkpoint=0, prompt_length=4261)  # cold: rebuilding later costs 4k tokens
    assert pol.split_now(Boundary(100, "system"), checkpoint=0, prompt_length=4261)  # long tail: split
    assert pol.split_now(Boundary(4258, "block"), checkpoint=4182, prompt_length=4261)  # baseline never defers
    assert CheckpointPolicy(defer_tail=0).split_now(history, 4182, 4261)  # 0 turns deferral off


def test_a_busy_engine_splits_instead_of_deferring():
    from hyserve.cache.policy import Boundary

    assert CheckpointPolicy(defer_tail=16).split_now(Boundary(4258, "history"), 4182, 4261, busy=True)

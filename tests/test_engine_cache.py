"""The prefix cache never changes output: cache on == cache off, token for token (greedy)."""

import random

import pytest
import torch

from hyserve.engine import GenerationRequest
from hyserve.engine.sampling import SamplingParams

from .conftest import FAMILIES, wait_idle

GREEDY = SamplingParams(temperature=0.0)
LONG = " ".join(["The quick brown fox jumps over the lazy dog while the robot paints."] * 6)

SCRIPT = [  # (system prompt, user message); a changed system prompt starts sharing afresh
    ("You are a helpful assistant.", "What is the capital of France? " + LONG),
    ("You are a helpful assistant.", "Why?"),  # a turn under 64 tokens
    ("You are a helpful assistant.", "Tell me a story about a robot who learns to paint. " + LONG),
    ("You are a pirate.", "Numbers: 0 1 2 3 4 5"),  # system prompt changed: history not shared
    ("You are a pirate.", "Write a function that returns the sum of two numbers."),
    ("You are a pirate.", "Thank you!"),
]


def run_chat(service, script=SCRIPT, max_tokens=8, pause=True, logprobs=0):
    """Drive a multi-turn chat like a client: the reply *text* goes back into the history.
    `pause`: after each reply wait, as a reader does, until the engine's idle-time checkpoint work is done.
    Per turn (tokens, cached tokens, prompt length, history length); with `logprobs` N, each token's logprob and
    the N likeliest's follow the tokens."""
    history, results, system = [], [], None
    for sys_prompt, user in script:
        if sys_prompt != system:
            history, system = [], sys_prompt
        messages = [{"role": "system", "content": sys_prompt}] + history + [{"role": "user", "content": user}]
        prompt = service.runtime.render_chat(messages, True)
        fin = service.engine.generate(
            GenerationRequest(
                prompt=prompt,
                max_tokens=max_tokens,
                sampling=SamplingParams(0.0, logprobs=logprobs) if logprobs else GREEDY,
                messages=messages,
            )
        )
        boundary = len(service.runtime.render_chat(messages, False))
        numbers = [[[lp, *(alt for _, alt in top)] for _, lp, top in fin.logprobs]] if logprobs else []
        results.append((fin.token_ids, *numbers, fin.cached_tokens, len(prompt), boundary))
        history = history + [{"role": "user", "content": user}, {"role": "assistant", "content": fin.text}]
        if pause:
            wait_idle(service)
    return results


@pytest.mark.parametrize("arch", FAMILIES)
def test_six_turn_chat_matches_cache_off(make_service, arch):
    on = run_chat(make_service(arch))
    off = run_chat(make_service(arch, cache_enabled=False))
    assert [r[0] for r in on] == [r[0] for r in off]
    assert all(r[1] == 0 for r in off)
    cached = [r[1] for r in on]
    assert cached[0] == 0
    for turn in (1, 2, 4, 5):  # history shared with the previous turn
        assert cached[turn] > 0, (turn, cached)
        assert cached[turn] < on[turn][2]
        # At least the previous turn's whole history (its prompt minus the generation prompt) is reused.
        assert cached[turn] >= on[turn - 1][3]


@pytest.mark.parametrize("arch", ["qwen3_5", "mamba2", "qwen3"])
def test_six_turn_chat_matches_cache_off_in_bfloat16(make_service, arch):
    """bfloat16 weights (float32 recurrent state), hyserve's kernels on: the cache still changes nothing."""
    on_service = make_service(arch, dtype="bfloat16")
    assert on_service.runtime.model.dtype == torch.bfloat16
    from .test_native_kernels import packs_bfloat16

    status = on_service.runtime.adapter.kernels.status
    off = {k for k, v in status.items() if v != "on"}  # only what this CPU cannot run may be off
    assert status and off <= ({"native_linear"} if not packs_bfloat16() else set()), status
    on = run_chat(on_service)
    off = run_chat(make_service(arch, dtype="bfloat16", cache_enabled=False))
    assert [r[0] for r in on] == [r[0] for r in off]
    assert all(on[turn][1] >= on[turn - 1][3] for turn in (1, 2, 4, 5))  # whole histories reused


@pytest.mark.parametrize("arch", ["qwen3_5", "mamba2"])
def test_back_to_back_turns_wait_for_the_checkpoints_left_to_a_job(make_service, arch):
    """`--defer-checkpoints`: each turn leaves its history boundary to a job after the reply. A client that
    sends turn N+1 the moment turn N ends leaves no idle time: turn N+1 (whose prompt extends the job) waits
    for the job, which is never lost, and restores at least from that boundary; output equals cache-off."""
    from hyserve.cache.policy import DEFER_TAIL, CheckpointPolicy

    on = make_service(arch, policy=CheckpointPolicy(defer_tail=DEFER_TAIL))
    got, want = (
        run_chat(on, SCRIPT[:3], pause=False),
        run_chat(make_service(arch, cache_enabled=False), SCRIPT[:3], pause=False),
    )
    assert [g[0] for g in got] == [w[0] for w in want]
    events = list(on.cache.telemetry.recent)
    deferred = [e for e in events if e["event"] == "deferred" and e["reason"] == "short_tail"]
    assert {e["kind"] for e in deferred} == {"history"} and len(deferred) == 3
    for turn in (1, 2):  # each turn's history boundary recorded before the next turn restored
        assert got[turn][1] >= got[turn - 1][3], got


def test_the_default_policy_defers_nothing(make_service):
    """Agents leave no idle time: by default every boundary is taken inside the prefill that reaches it."""
    svc = make_service("qwen3_5")
    run_chat(svc, SCRIPT[:3], pause=False)
    assert not any(e["event"] == "deferred" for e in svc.cache.telemetry.recent)


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_next", "mamba2"])
def test_deferral_off_checkpoints_inline_and_matches_cache_off(make_service, arch):
    """Every boundary taken inside the prefill that reaches it: captured from the same pass (Gated DeltaNet
    models) or by splitting the prefill there (mamba2). Output equals cache-off on every turn."""
    from hyserve.cache.policy import CheckpointPolicy

    # (no idle-time rebuilds of replies that do not re-tokenize: every pass counted below is a prompt's)
    svc = make_service(arch, policy=CheckpointPolicy(defer_tail=0, reply_rerender=False))
    pieces = _count_prefill_pieces(svc)
    got = run_chat(svc, pause=False)
    want = run_chat(make_service(arch, cache_enabled=False), pause=False)
    assert [g[0] for g in got] == [w[0] for w in want]
    events = list(svc.cache.telemetry.recent)
    assert not any(e["event"] == "deferred" for e in events)
    for turn in (1, 2, 4, 5):  # no idle time needed: each history checkpoint was taken mid-prefill
        assert got[turn][1] >= got[turn - 1][3]
    recorded = [e for e in events if e["event"] == "recorded" and e["kind"] in ("history", "system")]
    assert len(recorded) >= len(SCRIPT)
    # one forward pass per prompt (all are shorter than a chunk) when the state is captured, more when split
    assert (len(pieces) == len(SCRIPT)) == (arch != "mamba2"), pieces


def test_a_failed_capture_takes_no_checkpoint_and_output_stays_exact(make_service):
    """Fail closed: when the kernels hand out no states (here: the adapter reports none), the boundaries
    inside the pass are declined, nothing is recorded from them, and the output still equals cache-off."""
    from hyserve.cache.policy import CheckpointPolicy

    svc = make_service("qwen3_5", policy=CheckpointPolicy(defer_tail=0, reply_rerender=False))
    real = svc.runtime.adapter.forward_capturing
    svc.runtime.adapter.forward_capturing = lambda state, ids, offsets: (real(state, ids, offsets)[0], None)
    got = run_chat(svc, SCRIPT[:3], pause=False)
    want = run_chat(make_service("qwen3_5", cache_enabled=False), SCRIPT[:3], pause=False)
    assert [g[0] for g in got] == [w[0] for w in want]
    events = list(svc.cache.telemetry.recent)
    failed = [e for e in events if e["event"] == "declined" and e["reason"] == "capture_failed"]
    assert failed and not any(e["event"] == "recorded" and e["kind"] in ("history", "system") for e in events)


def _count_prefill_pieces(svc) -> list[int]:
    """Spy on the adapter: the length of every multi-token forward pass the prefill phase runs (a capturing
    pass runs through `forward` too; a finished reply's end-of-turn tokens, run after it, are not a piece)."""
    ad, prefill, pieces, inside = svc.runtime.adapter, svc.engine.prefill, [], []
    inner, chunk = ad.forward, prefill.chunk

    def spy(state, ids, *args, **kwargs):
        if inside and len(ids) > 1 and not kwargs.get("all_logits"):
            pieces.append(len(ids))
        return inner(state, ids, *args, **kwargs)

    def in_prefill(*args, **kwargs):
        inside.append(True)
        try:
            return chunk(*args, **kwargs)
        finally:
            inside.pop()

    ad.forward, prefill.chunk = spy, in_prefill
    return pieces


def _hf_generate(rt, prompt, n):
    import torch

    out = rt.model.generate(
        torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=rt.tokenizer.pad_token_id
    )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("arch", FAMILIES)
def test_cached_turn_equals_transformers_generate(make_service, arch):
    svc = make_service(arch)
    run_chat(svc, SCRIPT[:2])
    messages = [{"role": "system", "content": SCRIPT[0][0]}, {"role": "user", "content": "Hello again " + LONG}]
    prompt = svc.runtime.render_chat(messages, True)
    for _ in range(2):  # second time is served from the history checkpoint
        fin = svc.engine.generate(GenerationRequest(prompt=prompt, max_tokens=10, sampling=GREEDY, messages=messages))
        ref = _hf_generate(svc.runtime, prompt, 10)
        assert fin.token_ids == ref[: len(fin.token_ids)] and (len(fin.token_ids) == 10 or fin.reason == "stop")
    assert fin.cached_tokens > 0


def _random_conversations(rng, n):
    words = LONG.split() + ["café", "東京", "robot", "paint", "42", "?", "!"]
    convos = []
    for _ in range(n):
        turns = [" ".join(rng.choices(words, k=rng.randint(1, 30))) for _ in range(rng.randint(1, 4))]
        convos.append(turns)
    return convos


@pytest.mark.parametrize("arch", ["qwen3_5", "mamba2", "qwen3"])
def test_randomized_branching_conversations_match_cache_off(make_service, arch):
    """Many short chats through one shared cache, with edits of earlier messages and regenerations."""
    rng = random.Random(1234)
    on, off = make_service(arch, cache_bytes=2 << 20), make_service(arch, cache_enabled=False)
    system = {"role": "system", "content": "You are a helpful assistant."}
    for turns in _random_conversations(rng, 6):
        history = [system]
        for user in turns:
            action = rng.random()
            if action < 0.2 and len(history) > 2:  # edit an earlier user message: branch the tree
                history = history[:-2]
            messages = history + [{"role": "user", "content": user}]
            prompt = on.runtime.render_chat(messages, True)
            for _ in range(2 if action > 0.8 else 1):  # sometimes regenerate
                req = dict(prompt=prompt, max_tokens=rng.randint(1, 6), sampling=GREEDY, messages=messages)
                a = on.engine.generate(GenerationRequest(**req))
                b = off.engine.generate(GenerationRequest(**req))
                assert a.token_ids == b.token_ids
                assert a.cached_tokens < len(prompt)
            history = messages + [{"role": "assistant", "content": a.text}]
    assert on.cache.hits > 0
    assert on.cache.tree.total_bytes <= 2 << 20


@pytest.mark.parametrize("field,reason", [("num_tokens", "token_count_mismatch"), ("prefix_hash", "hash_mismatch")])
def test_tampered_snapshot_is_never_restored(make_service, field, reason):
    svc, ref = make_service("qwen3_5"), make_service("qwen3_5", cache_enabled=False)
    run_chat(svc, SCRIPT[:1])
    for _, s in svc.cache.tree.snapshots():
        object.__setattr__(s, field, s.num_tokens + 1 if field == "num_tokens" else "0" * 32)
    got = run_chat(svc, SCRIPT[:2])
    want = run_chat(ref, SCRIPT[:2])
    assert [g[0] for g in got] == [w[0] for w in want]
    events = list(svc.cache.telemetry.recent)
    assert any(e["event"] == "miss" and e["reason"] == reason for e in events)


def test_snapshot_with_wrong_kv_length_is_never_restored(make_service):
    svc, ref = make_service("qwen3_5"), make_service("qwen3_5", cache_enabled=False)
    run_chat(svc, SCRIPT[:1])
    for _, s in svc.cache.tree.snapshots():  # the full-attention layer's KV, in the snapshot's last segment
        layers = list(s.kv.layers)
        layers[3] = tuple(t[..., :-1, :] for t in layers[3])
        s.kv.layers = tuple(layers)
    assert [g[0] for g in run_chat(svc, SCRIPT[:2])] == [w[0] for w in run_chat(ref, SCRIPT[:2])]
    assert any(e["reason"] == "kv_length_mismatch" for e in svc.cache.telemetry.recent)


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3"])
def test_tiny_budget_evicts_and_stays_correct(make_service, arch):
    probe = make_service(arch)
    run_chat(probe, SCRIPT[:1])
    one = max(s.nbytes for _, s in probe.cache.tree.snapshots())
    budget = int(one * 2.5)
    svc, ref = make_service(arch, cache_bytes=budget), make_service(arch, cache_enabled=False)
    got, want = run_chat(svc), run_chat(ref)
    assert [g[0] for g in got] == [w[0] for w in want]
    assert svc.cache.tree.total_bytes <= budget
    assert any(e["event"] == "evicted" for e in svc.cache.telemetry.recent)


def test_no_duplicate_checkpoints_on_regeneration(make_service):
    svc = make_service("qwen3_5")
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "Hello " + LONG}]
    prompt = svc.runtime.render_chat(messages, True)
    recorded = []
    for _ in range(3):
        svc.engine.generate(GenerationRequest(prompt=prompt, max_tokens=3, sampling=GREEDY, messages=messages))
        wait_idle(svc)  # the deferred history checkpoint is recorded in idle time
        # idle-time reply rebuilds (kind reply_rerender) differ with each random reply; count the rest
        recorded.append(
            sum(e["event"] == "recorded" and e["kind"] != "reply_rerender" for e in svc.cache.telemetry.recent)
        )
    assert recorded[0] >= 2 and recorded[1] == recorded[2] == recorded[0]  # regenerations record nothing new
    depths = [s.num_tokens for _, s in svc.cache.tree.snapshots()]
    assert len(depths) == len(set(depths))
    assert any(e["event"] == "skipped" for e in svc.cache.telemetry.recent)


@pytest.mark.parametrize("arch", ["qwen3_5", "mamba2"])
def test_reply_that_does_not_retokenize_is_rebuilt_in_idle_time(make_service, arch):
    """Random weights emit replies whose ids do not survive decode+re-encode; after an idle moment
    the next turn still reuses *all* prior history, and outputs still equal cache-off."""
    on, off = make_service(arch), make_service(arch, cache_enabled=False)
    history, full_hits = [{"role": "system", "content": "You are a helpful assistant."}], 0
    for user in ["What is the capital of France?", "Why?", "Tell me a story about a robot."]:
        messages = history + [{"role": "user", "content": user}]
        prompt = on.runtime.render_chat(messages, True)
        req = dict(prompt=prompt, max_tokens=12, sampling=GREEDY, messages=messages)
        a, b = on.engine.generate(GenerationRequest(**req)), off.engine.generate(GenerationRequest(**req))
        assert a.token_ids == b.token_ids
        if len(history) > 1:
            prior = len(on.runtime.render_chat(history, False))
            assert a.cached_tokens == prior  # everything before the new user message
            assert prior == len(on.runtime.render_next_turn(history))  # (ChatML renders no turn differently)
            full_hits += 1
        history = messages + [{"role": "assistant", "content": a.text}]
        wait_idle(on)
    assert full_hits == 2
    assert any(e["event"] == "recorded" and e["kind"] == "reply_rerender" for e in on.cache.telemetry.recent)


def test_a_busy_engine_takes_history_checkpoints_mid_prefill(make_service):
    """Under load there is no idle time to build deferred checkpoints, so they are split inline."""
    import threading

    from hyserve.engine import Finished

    svc = make_service("qwen3_5")
    pieces = _count_prefill_pieces(svc)
    done = []
    cond = threading.Condition()

    def emit(item):
        if isinstance(item, Finished):
            with cond:
                done.append(item)
                cond.notify()

    with svc.runtime.lock:  # both requests are queued before the engine's first step can run
        for user in ("What is the capital of France?", "Tell me a story about a robot."):
            messages = [{"role": "system", "content": "S"}, {"role": "user", "content": user}]
            prompt = svc.runtime.render_chat(messages, True)
            svc.engine.submit(GenerationRequest(prompt=prompt, max_tokens=6, sampling=GREEDY, messages=messages), emit)
    with cond:
        assert cond.wait_for(lambda: len(done) == 2, timeout=60)
    events = list(svc.cache.telemetry.recent)
    assert not any(e["event"] == "deferred" for e in events)
    assert sum(e["event"] == "recorded" and e["kind"] == "history" for e in events) == 2
    assert len(pieces) == 2  # the boundaries were captured inside each prompt's one pass, not split there


def test_idle_time_work_runs_in_short_pieces(make_service):
    """A job of several hundred tokens runs in pieces of at most `background.PIECE` tokens, one per lock hold, so a
    request that arrives meanwhile waits for one piece, not a whole prefill chunk; its checkpoint is recorded."""
    from hyserve.cache.policy import Boundary
    from hyserve.engine import background
    from hyserve.engine.run import Job

    svc = make_service("qwen3_5", prefill_chunk=512)
    ad, pieces = svc.runtime.adapter, []
    inner = ad.forward

    def spy(state, ids, *args, **kwargs):
        if svc.engine._rebuilding:
            pieces.append(len(ids))
        return inner(state, ids, *args, **kwargs)

    ad.forward = spy
    tokens = [(7 * i) % 400 + 10 for i in range(450)]
    svc.engine.scheduler.add_background(Job(tokens, [Boundary(len(tokens), "history")], "", "job-1"))
    wait_idle(svc)
    assert sum(pieces) == len(tokens) and max(pieces) <= background.PIECE < 512
    assert svc.cache.has(tokens, "")


def test_replies_go_out_before_their_post_decode_checkpoints_and_the_next_turn_finds_them(make_service):
    """Two requests finishing in one step both emit their final item before either post-decode checkpoint is
    copied (no reply waits for a copy), yet a next turn, submitted the moment its reply arrives, restores
    from its checkpoint. (Requests that keep their final state, as the Responses API's `store` does: random
    replies do not re-render.)"""
    import threading

    from hyserve.engine.api import Finished

    svc = make_service("qwen3_5")
    prompts = [svc.runtime.render_chat([{"role": "user", "content": f"Hello {i} " + LONG}], True) for i in (1, 2)]
    seen, nxt, done = [], [], threading.Event()

    def recorded():
        return sum(e["event"] == "recorded" and e["kind"] == "post_decode" for e in svc.cache.telemetry.recent)

    def emit_for(prompt):
        def emit(item):
            if isinstance(item, Finished):  # on the model thread, the moment the reply is emitted
                seen.append(recorded())
                follow = GenerationRequest(prompt=prompt + item.token_ids + prompt[:5], max_tokens=2, sampling=GREEDY)
                svc.engine.submit(
                    follow,
                    lambda it: (nxt.append(it), len(nxt) == 2 and done.set()) if isinstance(it, Finished) else None,
                )

        return emit

    firsts = [GenerationRequest(prompt=p, max_tokens=6, sampling=GREEDY, keep_final=True) for p in prompts]
    with svc.runtime.lock:  # both are queued before the engine's first step: they decode and finish together
        for req, prompt in zip(firsts, prompts):
            svc.engine.submit(req, emit_for(prompt))
    assert done.wait(60)
    assert seen == [0, 0]
    assert {r.request_id for r in firsts} <= {
        e["request_id"] for e in svc.cache.telemetry.recent if e["event"] == "recorded" and e["kind"] == "post_decode"
    }
    assert sorted(f.cached_tokens for f in nxt) == sorted(len(p) + 6 for p in prompts)

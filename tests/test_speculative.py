"""Speculative decoding changes speed, never output: spec on == spec off, token for token (greedy)."""

import pytest

from hyserve.engine import GenerationRequest
from hyserve.engine.sampling import SamplingParams
from hyserve.engine.speculative import PromptLookup, SpeculativeConfig

from .conftest import FAMILIES

GREEDY = SamplingParams(temperature=0.0)
CODE = "def add(a, b):\n    return a + b\n\n" * 4
MSGS = [{"role": "user", "content": "Here is the file:\n" + CODE}]


class OracleProposer:
    """Proposes the true continuation, corrupted at chosen offsets: accept/reject runs of known lengths."""

    def __init__(self, prompt, reference, k=5, corrupt_every=4):
        self.n_prompt, self.ref, self.k, self.every = len(prompt), reference, k, corrupt_every
        self.context = list(prompt)

    def extend(self, tokens):
        self.context.extend(tokens)

    def propose(self):
        done = len(self.context) - self.n_prompt
        out = list(self.ref[done : done + self.k])
        if self.every and len(out) >= 3 and (done // self.every) % 2:
            out[2] = (out[2] + 1) % 400  # reject from the third proposal on
        return out


def generate(svc, max_tokens, stop=(), messages=MSGS):
    prompt = svc.runtime.render_chat(messages, True)
    return svc.engine.generate(
        GenerationRequest(prompt=prompt, max_tokens=max_tokens, sampling=GREEDY, stop=list(stop), messages=messages)
    )


def test_prompt_lookup_proposes_what_followed_the_last_occurrence():
    p = PromptLookup(SpeculativeConfig(num_tokens=3, ngram=2), [1, 2, 3, 4, 5, 1, 2])
    assert p.propose() == [3, 4, 5]
    p.extend([9])
    assert p.propose() == []
    p = PromptLookup(SpeculativeConfig(num_tokens=2, ngram=1), [7, 8, 7, 9, 7])
    assert p.propose() == [9, 7]  # the most recent earlier occurrence wins


@pytest.mark.parametrize("arch", FAMILIES)
@pytest.mark.parametrize("cache", [True, False])
def test_oracle_speculation_equals_plain_decode(make_service, arch, cache):
    plain = make_service(arch, cache_enabled=cache)
    spec = make_service(arch, cache_enabled=cache, speculative=SpeculativeConfig())
    ref = generate(plain, 24)
    spec.engine.make_proposer = lambda prompt: OracleProposer(prompt, ref.token_ids)
    got = generate(spec, 24)
    assert got.token_ids == ref.token_ids and got.text == ref.text
    accepted = spec.metrics.spec_accepted._value.get()
    assert accepted >= 8 and accepted < spec.metrics.spec_proposed._value.get()  # both paths taken
    # max_tokens ending inside an accepted run, for every length
    for n in range(1, 12):
        assert generate(spec, n).token_ids == ref.token_ids[:n]
    # a second turn restored from the cache still matches
    if cache:
        msgs = MSGS + [{"role": "assistant", "content": ref.text}, {"role": "user", "content": "again"}]
        r2 = generate(plain, 10, messages=msgs)
        spec.engine.make_proposer = lambda prompt: OracleProposer(prompt, r2.token_ids)
        assert generate(spec, 10, messages=msgs).token_ids == r2.token_ids


@pytest.mark.parametrize("arch", ["qwen3_5", "mamba2", "qwen3"])
def test_stop_string_inside_an_accepted_run(make_service, arch):
    plain, spec = make_service(arch), make_service(arch, speculative=SpeculativeConfig())
    ref = generate(plain, 30)
    spec.engine.make_proposer = lambda prompt: OracleProposer(prompt, ref.token_ids, k=8, corrupt_every=0)
    text = ref.text
    for start in (3, 9, 17):
        stop = text[start : start + 2]
        if not stop.strip() or "\ufffd" in stop:
            continue
        want = generate(plain, 30, stop=[stop])
        got = generate(spec, 30, stop=[stop])
        assert (got.token_ids, got.text, got.reason) == (want.token_ids, want.text, want.reason)
        assert got.reason == "stop"


def test_post_decode_checkpoint_is_not_starved(make_service):
    """Accepted tokens extend the generated list, so the post-decode checkpoint is taken."""
    spec = make_service("qwen3", speculative=SpeculativeConfig())
    ref = generate(make_service("qwen3"), 16)
    spec.engine.make_proposer = lambda prompt: OracleProposer(prompt, ref.token_ids, corrupt_every=0)
    out = generate(spec, 16)
    rec = [e for e in spec.cache.telemetry.recent if e["event"] == "recorded" and e["kind"] == "post_decode"]
    prompt_len = len(spec.runtime.render_chat(MSGS, True))
    history = spec.runtime.render_next_turn(MSGS + [{"role": "assistant", "content": out.text}])
    # every accepted token is in it: the state of prompt + 15 generated, run on to the end of the turn when the
    # reply re-renders as generated (the next turn's whole history)
    assert rec and rec[-1]["tokens"] in (prompt_len + 15, len(history)) and rec[-1]["tokens"] >= prompt_len + 15


@pytest.mark.parametrize("arch", FAMILIES)
def test_real_prompt_lookup_equals_plain_decode(make_service, arch):
    plain, spec = make_service(arch), make_service(arch, speculative=SpeculativeConfig(num_tokens=4, ngram=1))
    for msgs in (MSGS, [{"role": "user", "content": "Tell me a story about a robot."}]):
        assert generate(spec, 40, messages=msgs).token_ids == generate(plain, 40, messages=msgs).token_ids
    assert spec.metrics.spec_proposed._value.get() > 0


def test_sampling_requests_do_not_speculate(make_service):
    spec = make_service("qwen3_5", speculative=SpeculativeConfig(ngram=1))
    prompt = spec.runtime.render_chat(MSGS, True)
    spec.engine.generate(
        GenerationRequest(prompt=prompt, max_tokens=20, sampling=SamplingParams(temperature=0.8, seed=1))
    )
    assert spec.metrics.spec_proposed._value.get() == 0


def test_proposals_that_keep_failing_back_off(make_service):
    """A verify pass that accepts nothing costs more than a plain step: stop proposing for a while."""
    plain, spec = make_service("qwen3_5"), make_service("qwen3_5", speculative=SpeculativeConfig())

    class Wrong:
        def extend(self, tokens):
            pass

        def propose(self):
            return [1, 1, 1]  # never what the model produces

    ref = generate(plain, 40)
    spec.engine.make_proposer = lambda prompt: Wrong()
    got = generate(spec, 40)
    assert got.token_ids == ref.token_ids
    passes = spec.metrics.spec_seconds._sum is not None and sum(b.get() for b in spec.metrics.spec_seconds._buckets)
    assert 0 < passes <= 6  # cooldowns 2, 4, 8, 16, 32 steps: not one pass per step


class SometimesOracle(OracleProposer):
    """Proposes only on some steps, so its request moves between the shared decode batch and verify passes."""

    calls = 0

    def propose(self):
        self.calls += 1
        return super().propose() if self.calls % 2 else []


@pytest.mark.parametrize("arch", ["qwen3_5", "mamba2", "qwen3"])
def test_speculating_request_moving_in_and_out_of_the_decode_batch(make_service, arch):
    import threading

    from hyserve.engine import Finished

    plain = make_service(arch)
    prompts = ["Here is the file:\n" + CODE, "Tell me a story about a robot.", "Numbers: 0 1 2 3 4 5"]
    chats = [[{"role": "user", "content": p}] for p in prompts]
    refs = [generate(plain, 20, messages=m).token_ids for m in chats]
    spec = make_service(arch, speculative=SpeculativeConfig(), max_running=4)
    by_prompt = {tuple(spec.runtime.render_chat(m, True)): r for m, r in zip(chats, refs)}
    spec.engine.make_proposer = lambda prompt: SometimesOracle(prompt, by_prompt[tuple(prompt)], corrupt_every=3)
    done, cond = {}, threading.Condition()

    def emitter(i):
        def emit(item):
            if isinstance(item, Finished):
                with cond:
                    done[i] = item.token_ids
                    cond.notify()

        return emit

    with spec.runtime.lock:  # all three start together and decode side by side
        for i, m in enumerate(chats):
            prompt = spec.runtime.render_chat(m, True)
            spec.engine.submit(GenerationRequest(prompt=prompt, max_tokens=20, sampling=GREEDY, messages=m), emitter(i))
    with cond:
        assert cond.wait_for(lambda: len(done) == 3, timeout=120)
    assert [done[i] for i in range(3)] == refs
    assert spec.metrics.spec_accepted._value.get() > 0
    reg = spec.metrics.registry
    batched_rows = reg.get_sample_value("hyserve_decode_batch_size_sum")
    assert batched_rows > reg.get_sample_value("hyserve_decode_batch_size_count")  # some passes held several

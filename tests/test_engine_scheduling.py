"""How the engine shares a step between requests (scheduling, not cache correctness)."""

import threading

from hyserve.engine import Failed, Finished, GenerationRequest
from hyserve.engine.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0)


def _chat(svc, text):
    msgs = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": text}]
    return GenerationRequest(prompt=svc.runtime.render_chat(msgs, True), max_tokens=3, sampling=GREEDY, messages=msgs)


def _admitted_together(svc, reqs):
    """Submit `reqs` so one step admits them all; return, per step, which admitted requests ended it decoding."""
    eng, steps, done = svc.engine, [], []
    inner = eng._locked_step

    def spy(new):
        inner(new)
        if new:
            steps.append([run.decoding for run in new])

    eng._locked_step = spy
    try:
        with eng.scheduler.cond:  # the worker cannot admit until both are queued
            for r in reqs:
                ev = threading.Event()
                done.append(ev)
                eng.submit(r, lambda item, ev=ev: ev.set() if isinstance(item, (Finished, Failed)) else None)
        for ev in done:
            assert ev.wait(60)
    finally:
        eng._locked_step = inner
    return steps


def test_short_prompts_share_one_steps_prefill_budget(make_service):
    svc = make_service("qwen3_5")
    reqs = [_chat(svc, "Tell me a story about a robot."), _chat(svc, "What is the capital of France?")]
    assert sum(len(r.prompt) for r in reqs) < svc.engine.prefill_chunk
    steps = _admitted_together(svc, reqs)
    assert steps == [[True, True]]  # both prompts, with their checkpoint splits, prefilled in the first step


def test_a_prompt_longer_than_the_budget_still_takes_one_chunk_per_step(make_service):
    svc = make_service("qwen3_5", prefill_chunk=16)
    reqs = [_chat(svc, "Tell me a story about a robot who learns to paint."), _chat(svc, "Hi")]
    steps = _admitted_together(svc, reqs)
    assert steps == [[False, False]]  # 16 tokens of the first prompt, nothing that does not fit whole


def test_a_streams_first_token_is_handed_to_its_consumer_before_the_next_pass(make_service):
    """The model thread waits (briefly) after a stream's first token until the consumer has taken it; the
    items after it carry no such wait, and a consumer that is slow to come back does not stop the engine."""
    import asyncio

    svc = make_service("qwen3_5")
    eng = svc.engine
    seen = []
    flush = eng.outbox.flush

    def spy():
        seen.extend(
            (type(item).__name__, taken is not None and not taken.is_set()) for *_, item, taken in eng.outbox.items
        )
        flush()
        seen.extend(("taken-after-flush", taken.is_set()) for taken in firsts if taken is not None)

    firsts = []

    async def consume():
        items = eng.stream(_chat(svc, "Tell me a story about a robot."))
        got = []
        async for item in items:
            got.append(item)
            if len(got) == 2:
                await asyncio.sleep(0.05)  # slow to come back for the third: the engine keeps going
        return got

    class Box(list):
        def append(self, entry):
            if entry[-1] is not None:
                firsts.append(entry[-1])
            super().append(entry)

    eng.outbox.flush, eng.outbox.items = spy, Box()
    try:
        got = asyncio.run(consume())
    finally:
        del eng.outbox.flush
        eng.outbox.items = []
    assert isinstance(got[-1], Finished)
    waits = [waiting for name, waiting in seen if name in ("Delta", "Finished")]
    assert len(waits) == len(got) and waits[0] and not any(waits[1:])  # only the first item makes it wait
    assert ("taken-after-flush", True) in seen  # the consumer's taking it is what the wait listens for


def test_the_live_state_gauge_counts_running_states_and_drops_to_zero_when_idle(make_service, monkeypatch):
    """`hyserve_live_state_bytes`: what running requests hold (the RSS beyond the cache's budget that grows
    with load) is sampled between steps; it is non-zero while requests run and 0 once none does."""
    import hyserve.engine.core as engine_module

    monkeypatch.setattr(engine_module, "LIVE_BYTES_EVERY", 0.0)  # sample after every step
    svc = make_service("qwen3_5")
    eng, seen = svc.engine, []
    inner = eng._sample_live_bytes

    def spy():
        running = len(eng.scheduler.running)
        inner()
        seen.append((running, svc.metrics.registry.get_sample_value("hyserve_live_state_bytes")))

    eng._sample_live_bytes = spy
    _admitted_together(svc, [_chat(svc, "Tell me a story about a robot."), _chat(svc, "Hi")])
    for _ in range(500):  # the worker samples once more after the step that finished the last request
        if seen and not seen[-1][0]:
            break
        threading.Event().wait(0.01)
    busy = [b for n, b in seen if n]
    assert busy and all(b > 0 for b in busy)
    assert seen[-1] == (0, 0.0)

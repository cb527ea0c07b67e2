"""How the engine shares a step between requests (scheduling, not cache correctness)."""

import threading

from hyserve.engine import Failed, Finished, GenerationRequest
from hyserve.sampling import SamplingParams

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

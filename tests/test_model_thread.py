"""All model work in the process runs on one thread (OpenMP throttles itself once two threads own pools)."""

import threading

import pytest

from hyserve import model_thread
from hyserve.engine import GenerationRequest
from hyserve.engine.sampling import SamplingParams


def test_run_returns_results_and_raises_errors_of_the_call():
    assert model_thread.run(lambda a, b=0: a + b, 2, b=3) == 5
    with pytest.raises(KeyError):
        model_thread.run({}.__getitem__, "missing")
    name = model_thread.run(lambda: threading.current_thread().name)
    assert name == "hyserve-model"
    assert model_thread.run(lambda: model_thread.run(lambda: 7)) == 7  # nested: direct, no deadlock


def test_every_engine_runs_its_forward_passes_on_the_model_thread(make_service, monkeypatch):
    seen = set()
    services = [make_service("qwen3_5"), make_service("qwen3_5", cache_enabled=False)]
    for svc in services:
        ad = svc.runtime.adapter
        for name in ("forward", "forward_batch"):
            inner = getattr(ad, name)

            def spy(*a, _inner=inner, **k):
                seen.add(threading.current_thread().name)
                return _inner(*a, **k)

            monkeypatch.setattr(ad, name, spy)
    msgs = [{"role": "user", "content": "Hello there, how are you?"}]
    for svc in services:
        prompt = svc.runtime.render_chat(msgs, True)
        svc.engine.generate(
            GenerationRequest(prompt=prompt, max_tokens=4, sampling=SamplingParams(temperature=0.0), messages=msgs)
        )
    assert seen == {"hyserve-model"}


def _denormals_left() -> int:
    import torch

    tiny = torch.full((1 << 17,), 1e-39)  # large enough for OpenMP workers to take part
    return int((tiny * 1.0).count_nonzero())


def test_model_thread_flushes_denormals_and_other_threads_do_not():
    assert model_thread.flush_denormal_enabled()
    assert model_thread.run(_denormals_left) == 0
    out = []
    t = threading.Thread(target=lambda: out.append(_denormals_left()))
    t.start()
    t.join()
    assert out == [1 << 17]  # the same operation keeps denormals on a thread without the flag

"""The same guarantees on a GPU: greedy output with the cache on equals the cache off and transformers, decode
batches, snapshots, the disk tier, structured output, logits processors and speculation, all on CUDA.

Marked `cuda` and skipped where CUDA is not available (`pytest -m cuda` on a GPU machine runs them alone).
`HYSERVE_CUDA_TESTS_DEVICE=cpu` runs them on the CPU instead, to check the tests themselves.
"""

import json
import os

import pytest
import torch

from hyserve import model_thread
from hyserve.engine import GenerationRequest
from hyserve.engine.grammar import Spec
from hyserve.engine.sampling import SamplingParams
from hyserve.engine.speculative import SpeculativeConfig

from .cache.test_disk import PROMPT, state_after, tier, written
from .test_engine_cache import run_chat
from .test_speculative import OracleProposer
from .test_speculative import generate as generate_code
from .test_structured import SCHEMA, matches_schema
from .test_structured import generate as generate_json

DEVICE = os.environ.get("HYSERVE_CUDA_TESTS_DEVICE", "cuda")

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        DEVICE.startswith("cuda") and not torch.cuda.is_available(),
        reason=f"needs CUDA (torch {torch.__version__} sees no GPU)",
    ),
]

DTYPES = ["float32", "bfloat16"]


@pytest.fixture
def service(make_service):
    """A service of a tiny model on the GPU."""
    return lambda arch="qwen3_5", **kw: make_service(arch, device=DEVICE, **kw)


def hf_greedy(rt, prompt, n):
    out = rt.model.generate(
        torch.tensor([prompt], device=rt.model.device),
        max_new_tokens=n,
        do_sample=False,
        pad_token_id=rt.tokenizer.pad_token_id,
    )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe"])
def test_cache_on_equals_cache_off_and_transformers(service, arch, dtype):
    on, off = service(arch, dtype=dtype), service(arch, dtype=dtype, cache_enabled=False)
    assert on.runtime.model.device.type == torch.device(DEVICE).type
    got, want = run_chat(on), run_chat(off)
    assert [r[0] for r in got] == [r[0] for r in want]
    assert any(r[1] > 0 for r in got)  # turns were served from the cache
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = on.runtime.render_chat(messages, True)
    fin = on.engine.generate(
        GenerationRequest(prompt=prompt, max_tokens=12, sampling=SamplingParams(temperature=0), messages=messages)
    )
    ref = hf_greedy(on.runtime, prompt, 12)
    assert fin.token_ids == ref[: len(fin.token_ids)]


def test_a_decode_batch_equals_each_request_alone(service):
    ad = service().runtime.adapter
    prompts = [list(range(3, 3 + n)) for n in (5, 17, 40)]

    def alone(prompt):
        state, out = ad.new_state(), []
        logits = ad.forward(state, prompt)
        for _ in range(8):
            out.append(int(torch.argmax(logits)))
            logits = ad.forward(state, [out[-1]])
        return out

    def batched():
        states = [ad.new_state() for _ in prompts]
        logits = torch.stack([ad.forward(s, p) for s, p in zip(states, prompts)])
        outs = [[] for _ in prompts]
        for _ in range(8):
            tokens = logits.argmax(dim=-1).tolist()
            for out, t in zip(outs, tokens):
                out.append(t)
            logits = ad.forward_batch(states, tokens)
        ad.drop_batch()
        return outs

    assert model_thread.run(batched) == [model_thread.run(alone, p) for p in prompts]


def test_a_snapshot_stays_on_the_gpu_and_restores_exactly(service):
    ad = service().runtime.adapter

    def run():
        live = state_after(ad, PROMPT)
        snap = ad.snapshot(live)
        devices = {
            t.device.type for layer in snap.cache.layers for t in vars(layer).values() if isinstance(t, torch.Tensor)
        }
        restored = ad.restore(snap, PROMPT)
        return devices, ad.forward(live, [7, 8, 9], all_logits=True), ad.forward(restored, [7, 8, 9], all_logits=True)

    devices, want, got = model_thread.run(run)
    assert devices == {torch.device(DEVICE).type}
    assert torch.equal(want, got)


def test_the_disk_tier_reads_back_onto_the_gpu(service, tmp_path):
    ad = service().runtime.adapter
    live = model_thread.run(state_after, ad, PROMPT)
    written(tier(tmp_path), "", model_thread.run(ad.snapshot, live)).close()
    disk = tier(tmp_path)
    entry = disk.find(PROMPT + [7, 8], "", 0, 100)
    assert entry is not None and entry.num_tokens == len(PROMPT)
    snap = model_thread.run(disk.load, entry, ad)
    assert {
        t.device.type for layer in snap.cache.layers for t in vars(layer).values() if isinstance(t, torch.Tensor)
    } == {torch.device(DEVICE).type}
    restored = model_thread.run(ad.restore, snap, PROMPT)
    want = model_thread.run(ad.forward, live, [7, 8, 9], True)
    assert torch.equal(want, model_thread.run(ad.forward, restored, [7, 8, 9], True))


def test_structured_output_on_the_gpu(service):
    svc = service()
    fin = generate_json(svc, Spec("json", json.dumps(SCHEMA), "response_format"))
    assert fin.reason == "stop" and matches_schema(json.loads(fin.text))


def test_logits_processors_and_seeded_sampling_on_the_gpu(service):
    svc = service()
    messages = [{"role": "user", "content": "Tell me a story about a robot."}]
    prompt = svc.runtime.render_chat(messages, True)
    params = SamplingParams(
        temperature=0.9,
        top_p=0.9,
        top_k=50,
        seed=5,
        logit_bias=((5, 3.0),),
        presence_penalty=0.5,
        frequency_penalty=0.3,
        repetition_penalty=1.2,
        min_tokens=4,
        logprobs=3,
    )

    def sample():
        return svc.engine.generate(GenerationRequest(prompt=prompt, max_tokens=12, sampling=params, messages=messages))

    first = sample()
    assert len(first.token_ids) >= 4 and sample().token_ids == first.token_ids


def test_speculation_rolls_back_on_the_gpu(service):
    plain, spec = service(), service(speculative=SpeculativeConfig())
    ref = generate_code(plain, 24)
    spec.engine.make_proposer = lambda prompt: OracleProposer(prompt, ref.token_ids)
    assert generate_code(spec, 24).token_ids == ref.token_ids
    assert 0 < spec.metrics.spec_accepted._value.get() < spec.metrics.spec_proposed._value.get()

"""Logits processors against independent references (transformers' own processors, hand arithmetic)."""

import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from hyserve.engine import logits as lp
from hyserve.engine.sampling import SamplingParams


def test_repetition_penalty_equals_transformers():
    row = torch.randn(50, generator=torch.Generator().manual_seed(0))
    prompt, generated = [3, 7, 7], [9, 3, 11]
    pipe = lp.build(SamplingParams(repetition_penalty=1.7), prompt, [0])
    want = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([prompt + generated]), row[None].clone())[0]
    assert torch.allclose(pipe(row, generated), want)


def test_presence_frequency_and_bias_arithmetic():
    row = torch.zeros(10)
    pipe = lp.build(SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, logit_bias=((4, 3.0),)), [1], [0])
    out = pipe(row, [2, 2, 5])
    want = torch.zeros(10)
    want[2], want[5], want[4] = -0.5 - 0.5, -0.5 - 0.25, 3.0
    assert torch.equal(out, want)
    assert torch.equal(row, torch.zeros(10))  # the engine's logits are never edited


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    pipe = lp.build(SamplingParams(min_tokens=2, stop_token_ids=(6,)), [1], [0])
    early, late = pipe(torch.zeros(8), [5]), pipe(torch.zeros(8), [5, 5])
    assert early[0] == early[6] == float("-inf") and torch.isfinite(early[1:6]).all()
    assert torch.isfinite(late).all()
    assert not lp.build(SamplingParams(), [1], [0])  # nothing asked: an empty pipeline, raw logits


def test_token_logprobs_top_k():
    row = torch.tensor([0.0, 2.0, 1.0])
    token, value, top = lp.token_logprobs(row, 2, 2)
    ref = torch.log_softmax(row, -1)
    assert token == 2 and abs(value - ref[2].item()) < 1e-6
    assert [i for i, _ in top] == [1, 2] and abs(top[0][1] - ref[1].item()) < 1e-6

"""Turn next-token logits into a token: greedy, or temperature / top-k / top-p sampling with a seed."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Temperatures below this sample as greedy (as vLLM's _SAMPLING_EPS): dividing float32 logits by a temperature
# near 1e-38 overflows to inf, and the softmax of that is NaN.
SAMPLING_EPS = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    seed: int | None = None
    # Logits processors (`hyserve.engine.logits`), applied to a request's logits row before sampling:
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    presence_penalty: float = 0.0  # subtracted once from each token already generated
    frequency_penalty: float = 0.0  # subtracted per occurrence in the generated tokens
    repetition_penalty: float = 1.0  # divides positive / multiplies negative logits of prompt + generated tokens
    min_tokens: int = 0  # end-of-sequence and stop_token_ids are masked until this many tokens are generated
    stop_token_ids: tuple[int, ...] = ()  # generating one of these ends the request ("stop")
    logprobs: int | None = None  # None: no logprobs; k: the sampled token's logprob and the k most likely

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS or self.top_k == 1


class Sampler:
    """One per request, so a `seed` makes that request reproducible whatever else runs."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self.generator = torch.Generator(device="cpu")
        if params.seed is not None:
            self.generator.manual_seed(params.seed)
        else:
            self.generator.seed()

    def __call__(self, logits: torch.Tensor) -> int:
        p = self.params
        if p.greedy:
            return int(torch.argmax(logits))
        logits = logits.float().cpu() / p.temperature
        if p.top_k and p.top_k > 0 and p.top_k < logits.numel():
            kth = torch.topk(logits, p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            cumulative = torch.cumsum(sorted_probs, dim=-1)
            drop = cumulative - sorted_probs > p.top_p  # keep the smallest set whose mass reaches top_p
            sorted_probs = sorted_probs.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        return int(torch.multinomial(probs, 1, generator=self.generator))

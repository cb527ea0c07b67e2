"""Per-request logits processors: what turns a request's raw next-token logits into the row its `Sampler`
draws from (logit_bias, penalties, min_tokens masking).

A processor is a callable `(logits, generated) -> logits` over one request's float32 row, where `generated`
is every token the request has produced so far. Processors are pure functions of (logits, generated) plus
what they were built with, so the same tokens give the same row whatever batch the request ran in, with
the prefix cache on or off. A constrained-decoding mask is one more processor: `Pipeline.add`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .sampling import SamplingParams

Processor = Callable[[torch.Tensor, Sequence[int]], torch.Tensor]
MAX_LOGPROBS = 20  # top_logprobs / logprobs upper bound (OpenAI's for chat)


class LogitBias:
    """OpenAI `logit_bias`: a fixed amount added to chosen tokens' logits (-100 bans, +100 forces)."""

    def __init__(self, bias: Sequence[tuple[int, float]]):
        self.ids = torch.tensor([t for t, _ in bias], dtype=torch.long)
        self.values = torch.tensor([b for _, b in bias], dtype=torch.float32)

    def __call__(self, logits, generated):
        return logits.index_add_(0, self.ids, self.values)


SCALED_LIMIT = 1e30  # |logit| after the repetition penalty: times 1/temperature (at most 1e5) it stays finite


class Penalties:
    """presence / frequency penalties over the generated tokens (OpenAI), and the multiplicative repetition
    penalty over prompt + generated tokens (HF / vLLM / CTRL)."""

    def __init__(self, params: SamplingParams, prompt: Sequence[int]):
        self.presence, self.frequency = params.presence_penalty, params.frequency_penalty
        self.repetition = params.repetition_penalty
        self.prompt_ids = torch.tensor(sorted(set(prompt)), dtype=torch.long)

    def __call__(self, logits, generated):
        if generated:
            counts = torch.bincount(torch.tensor(generated, dtype=torch.long), minlength=logits.numel())
            counts = counts[: logits.numel()].to(logits.dtype)
            if self.frequency:
                logits -= self.frequency * counts
            if self.presence:
                logits -= self.presence * (counts > 0).to(logits.dtype)
        if self.repetition != 1.0:
            seen = torch.zeros(logits.numel(), dtype=torch.bool)
            seen[self.prompt_ids] = True
            if generated:
                seen[torch.tensor(generated, dtype=torch.long)] = True
            scaled = torch.where(logits > 0, logits / self.repetition, logits * self.repetition)
            # a tiny penalty (5e-324) would make inf, and the sampler's 1/temperature then NaN: a finite bound
            scaled = scaled.clamp(-SCALED_LIMIT, SCALED_LIMIT)
            logits = torch.where(seen, scaled, logits)
        return logits


class MinTokens:
    """Bans the tokens that would end the request (EOS, stop_token_ids) until `count` tokens are generated."""

    def __init__(self, count: int, ending: Sequence[int]):
        self.count, self.ids = count, torch.tensor(sorted(set(ending)), dtype=torch.long)

    def __call__(self, logits, generated):
        if len(generated) < self.count:
            logits[self.ids] = float("-inf")
        return logits


class Pipeline:
    """A request's processors in order; empty (falsy) when the raw logits go straight to the sampler."""

    def __init__(self, processors: list[Processor] | None = None):
        self.processors: list[Processor] = list(processors or [])

    def add(self, processor: Processor) -> None:
        self.processors.append(processor)

    def __bool__(self) -> bool:
        return bool(self.processors)

    def __call__(self, logits: torch.Tensor, generated: Sequence[int]) -> torch.Tensor:
        if not self.processors:
            return logits
        row = logits.detach().float().cpu().clone()  # never edit the logits the engine keeps
        for proc in self.processors:
            row = proc(row, generated)
        return row


def build(params: SamplingParams, prompt: Sequence[int], eos_ids: Sequence[int]) -> Pipeline:
    """The processors a request's sampling params ask for."""
    pipe = Pipeline()
    if params.logit_bias:
        pipe.add(LogitBias(params.logit_bias))
    if params.presence_penalty or params.frequency_penalty or params.repetition_penalty != 1.0:
        pipe.add(Penalties(params, prompt))
    ending = set(eos_ids) | set(params.stop_token_ids)
    if params.min_tokens > 0 and ending:
        pipe.add(MinTokens(params.min_tokens, ending))
    return pipe


def token_logprobs(logits: torch.Tensor, token: int, top: int) -> tuple[int, float, list[tuple[int, float]]]:
    """(token, its logprob, the `top` most likely (id, logprob)) under the processed logits, before
    temperature / top-k / top-p (vLLM's default: the model's distribution, not the sampling one)."""
    lp = torch.log_softmax(logits.detach().float().cpu(), dim=-1)
    best = []
    if top > 0:
        values, ids = torch.topk(lp, min(top, lp.numel()))
        best = list(zip(ids.tolist(), values.tolist()))
    return token, float(lp[token]), best

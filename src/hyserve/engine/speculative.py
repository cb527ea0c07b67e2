"""Prompt-lookup speculative decoding with exact rollback of recurrent state.

Proposals: the k tokens that followed the most recent earlier occurrence of the last n generated
tokens in the context (prompt + output). Verification: one forward pass over [token, d1..dk]; the
longest prefix where the model's greedy choice equals the proposal is accepted, plus one bonus token.

Rollback: attention KV is simply cut back. Recurrent layers have already absorbed the rejected
tokens, so before verifying we copy their (fixed-size) conv + SSM state, and on a rejection restore
it and re-run only the kept tokens. Keeping per-position states inside the verify pass would avoid
the re-run, but transformers' reference delta-rule and SSM kernels return only the final state.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SpeculativeConfig:
    num_tokens: int = 6  # k: proposals per verify pass
    ngram: int = 3  # n: length of the suffix that must recur in the context


class PromptLookup:
    """Incremental n-gram index over one request's context: proposing is O(k) per step."""

    def __init__(self, config: SpeculativeConfig, context: list[int]):
        self.k, self.n = config.num_tokens, config.ngram
        self.context: list[int] = []
        self.last_seen: dict[tuple[int, ...], int] = {}  # n-gram -> end index of its latest occurrence
        self.extend(context)

    def extend(self, tokens) -> None:
        for t in tokens:
            self.context.append(int(t))
            end = len(self.context)
            if end > self.n:  # index the n-gram ending just before the newest token
                self.last_seen[tuple(self.context[end - 1 - self.n : end - 1])] = end - 1

    def propose(self) -> list[int]:
        if len(self.context) < self.n:
            return []
        start = self.last_seen.get(tuple(self.context[-self.n :]))
        if start is None:
            return []
        return self.context[start : start + self.k]


def accepted_prefix(all_logits, proposals: list[int]) -> int:
    """How many proposals the model itself would have produced greedily (logits row i predicts d_{i+1})."""
    choices = all_logits[: len(proposals)].argmax(dim=-1).tolist()
    j = 0
    while j < len(proposals) and choices[j] == proposals[j]:
        j += 1
    return j

"""Forced replies, for tests and benchmarks: a random-weight model never writes a tool call or a closed
reasoning block, so code that parses, streams and caches such replies is exercised by making a request
generate a given text. Only sampling is replaced, and only for requests carrying a scripted seed: the
prompt is rendered, restored and prefilled as always, every forced token runs through the model, and the
reply is parsed and recorded as any other."""

from __future__ import annotations

import itertools

from .sampling import Sampler


class ForcedReplies:
    """`install()` patches `Sampler.__call__` (`uninstall()` puts it back); `seed_for(tokenizer, text)` gives a
    seed whose request generates `text`'s tokens, then end of turn."""

    def __init__(self, first_seed: int = 424242):
        self.scripts: dict[int, list[int]] = {}
        self._seeds = itertools.count(first_seed)
        self._sample = None

    def install(self) -> "ForcedReplies":
        sample = self._sample = Sampler.__call__
        scripts = self.scripts

        def scripted(sampler, logits):
            script = scripts.get(sampler.params.seed)
            if script is None:
                return sample(sampler, logits)
            at = sampler.__dict__.get("_forced_at", 0)
            sampler._forced_at = at + 1
            return script[min(at, len(script) - 1)]

        Sampler.__call__ = scripted
        return self

    def uninstall(self) -> None:
        if self._sample is not None:
            Sampler.__call__ = self._sample
            self._sample = None

    def seed_for(self, tokenizer, text: str) -> int:
        seed = next(self._seeds)
        self.scripts[seed] = list(tokenizer(text, add_special_tokens=False)["input_ids"]) + [tokenizer.eos_token_id]
        return seed

"""Test aids, not used by the server: forced replies (`ForcedReplies`).

A random-weight model never writes a tool call or a closed reasoning block, so code that parses, streams and
caches such replies is exercised by making a request generate a given text. Only sampling is replaced, through
the engine's sampler hook (`Engine.make_sampler`), and only for requests carrying a scripted seed: the prompt is
rendered, restored and prefilled as always, every forced token runs through the model, and the reply is parsed
and recorded as any other."""

from __future__ import annotations

import itertools


class ForcedReplies:
    """`attach(engine)` makes that engine's requests with a scripted seed generate their script (`detach()`
    puts every attached engine's sampler back); `seed_for(tokenizer, text)` gives a seed whose request
    generates `text`'s tokens, then end of turn."""

    def __init__(self, first_seed: int = 424242):
        self.scripts: dict[int, list[int]] = {}
        self._seeds = itertools.count(first_seed)
        self._attached: dict[int, tuple] = {}  # id(engine) -> (engine, its own make_sampler)

    def attach(self, engine) -> ForcedReplies:
        if id(engine) in self._attached:
            return self
        make, scripts = engine.make_sampler, self.scripts
        self._attached[id(engine)] = (engine, make)
        engine.make_sampler = lambda params: Scripted(make(params), scripts)
        return self

    def detach(self) -> None:
        for engine, make in self._attached.values():
            engine.make_sampler = make
        self._attached.clear()

    def seed_for(self, tokenizer, text: str) -> int:
        seed = next(self._seeds)
        self.scripts[seed] = list(tokenizer(text, add_special_tokens=False)["input_ids"]) + [tokenizer.eos_token_id]
        return seed


class Scripted:
    """A request's sampler that returns its seed's script one token per call (the last one from then on),
    or samples as `sampler` does when the seed has none."""

    def __init__(self, sampler, scripts: dict[int, list[int]]):
        self.sampler, self.scripts, self.at = sampler, scripts, 0

    @property
    def params(self):
        return self.sampler.params

    def __call__(self, logits) -> int:
        script = self.scripts.get(self.sampler.params.seed)
        if script is None:
            return self.sampler(logits)
        at, self.at = self.at, self.at + 1
        return script[min(at, len(script) - 1)]

"""Constrained decoding in the engine: the matcher sees only accepted tokens, with speculation and the cache."""

import json

import pytest
import torch

from hyserve.engine import GenerationRequest
from hyserve.engine.grammar import Constraint, Grammars, Spec
from hyserve.engine.sampling import SamplingParams
from hyserve.engine.speculative import SpeculativeConfig

from .test_speculative import OracleProposer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["name", "ok", "color", "n"],
    "additionalProperties": False,
}
MSGS = [{"role": "user", "content": "Give me a person as JSON."}]


def grammars(rt) -> Grammars:
    return Grammars(rt.tokenizer, rt.model.config.get_text_config().vocab_size, rt.eos_token_ids)


def matches_schema(obj) -> bool:
    return (
        isinstance(obj, dict)
        and set(obj) == {"name", "ok", "color", "n"}
        and isinstance(obj["name"], str)
        and len(obj["name"]) <= 8
        and isinstance(obj["ok"], bool)
        and obj["color"] in ("red", "green")
        and type(obj["n"]) is int
        and 0 <= obj["n"] <= 99
    )


def generate(svc, spec: Spec, max_tokens=60):
    prompt = svc.runtime.render_chat(MSGS, True)
    req = GenerationRequest(
        prompt=prompt,
        max_tokens=max_tokens,
        sampling=SamplingParams(temperature=0.0),
        messages=MSGS,
        grammar=grammars(svc.runtime).compile(spec),
    )
    return svc.engine.generate(req)


def test_eos_only_where_the_grammar_accepts(runtimes):
    rt = runtimes("qwen3_5")
    tok, g = rt.tokenizer, grammars(rt)
    c = g.compile(Spec("regex", "ab", "guided_regex")).start()
    logits = torch.zeros(g.vocab_size)
    eos = sorted(rt.eos_token_ids)
    assert all(c.mask(logits)[e] == float("-inf") for e in eos)
    for t in tok("ab", add_special_tokens=False)["input_ids"]:
        assert c.accept(t)
    allowed = (c.mask(logits) > float("-inf")).nonzero().flatten().tolist()
    assert allowed and set(allowed) <= set(eos)
    assert not c.accept(tok("a", add_special_tokens=False)["input_ids"][0])  # refused: the matcher is in error
    assert c.mask(logits) is None  # a dead end


@pytest.mark.parametrize("cache", [True, False])
def test_constrained_speculation_and_cache_equal_plain_decode(make_service, cache):
    """Greedy JSON on random weights: valid for the schema, and the same with the cache off and with oracle
    speculation, whose verify pass accepts only what the masked logits pick at each position."""
    spec = Spec("json", json.dumps(SCHEMA), "response_format")
    plain = make_service("qwen3_5", cache_enabled=cache)
    ref = generate(plain, spec)
    assert ref.reason == "stop" and matches_schema(json.loads(ref.text))
    assert generate(plain, spec).token_ids == ref.token_ids  # again, from the cache when it is on
    spec_svc = make_service("qwen3_5", cache_enabled=cache, speculative=SpeculativeConfig())
    spec_svc.engine.make_proposer = lambda prompt: OracleProposer(prompt, ref.token_ids)
    got = generate(spec_svc, spec)
    assert got.token_ids == ref.token_ids and got.text == ref.text
    accepted = spec_svc.metrics.spec_accepted._value.get()
    assert accepted >= 8 and accepted < spec_svc.metrics.spec_proposed._value.get()  # both paths taken


def test_a_dead_end_ends_the_request_cleanly(make_service, monkeypatch):
    svc = make_service("qwen3_5")
    spec = Spec("regex", "[a-z]{20}", "guided_regex")
    mask = Constraint.mask
    calls = []

    def dead_after_three(self, logits):
        calls.append(1)
        return None if len(calls) > 3 else mask(self, logits)

    monkeypatch.setattr(Constraint, "mask", dead_after_three)
    out = generate(svc, spec)
    assert out.reason == "stop" and len(out.token_ids) == 3
    monkeypatch.setattr(Constraint, "mask", mask)
    again = generate(svc, spec)  # the engine goes on serving
    assert again.reason == "stop" and len(again.text) == 20 and again.text.isalpha()


def test_after_a_reasoning_block_only_the_answer_is_constrained(runtimes):
    """A reply that opens inside `<think>` is free until the end tag, then held to the grammar."""
    import dataclasses

    rt = runtimes("qwen3_5")
    tok, g = rt.tokenizer, grammars(rt)
    end = tuple(tok.encode("</think>", add_special_tokens=False))
    c = dataclasses.replace(g.compile(Spec("regex", "ab", "guided_regex")), after=end).start()
    logits = torch.randn(g.vocab_size)
    for t in tok.encode("I think z", add_special_tokens=False) + list(end):
        assert torch.equal(c.mask(logits), logits)  # reasoning: nothing masked, EOS included
        assert c.accept(t)
    allowed = (c.mask(logits) > float("-inf")).nonzero().flatten().tolist()
    assert allowed and all(tok.decode([t]) and "ab".startswith(tok.decode([t])) for t in allowed)

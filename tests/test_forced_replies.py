"""Forced replies (`hyserve.testing.forced`) go through the engine's sampler hook: only the engines they are attached
to, only requests with a scripted seed, and detaching puts the engine's own sampler back."""

from hyserve.engine.api import GenerationRequest
from hyserve.engine.sampling import Sampler, SamplingParams
from hyserve.testing.forced import ForcedReplies

PROMPT = [5, 17, 42, 8, 99, 23, 61, 7, 3]


def _tokens(svc, seed: int, n: int = 12) -> list[int]:
    req = GenerationRequest(prompt=list(PROMPT), max_tokens=n, sampling=SamplingParams(seed=seed))
    return svc.engine.generate(req).token_ids


def test_a_scripted_seed_generates_its_script_on_the_attached_engine_only(make_service):
    on, other = make_service("qwen3"), make_service("qwen3")
    own_call = Sampler.__call__
    plain = _tokens(on, 424242)
    forced = ForcedReplies().attach(on.engine)
    seed = forced.seed_for(on.runtime.tokenizer, "Paris is sunny.")
    assert seed == 424242
    script = forced.scripts[seed]
    assert _tokens(on, seed) == script  # ends at the script's end of turn
    assert _tokens(on, seed + 1) == _tokens(other, seed + 1)  # another seed: sampled as usual
    assert _tokens(other, seed) == plain  # an engine it is not attached to
    assert Sampler.__call__ is own_call  # nothing replaced on the class
    forced.detach()
    assert on.engine.make_sampler is Sampler
    assert _tokens(on, seed) == plain

"""Streaming text never splits a UTF-8 character and never leaks part of a stop string."""

import torch

from hyserve.engine.detokenize import IncrementalDetokenizer, StopStringFilter
from hyserve.engine.sampling import Sampler, SamplingParams


def test_multibyte_characters_are_not_split(runtimes):
    tok = runtimes("qwen3").tokenizer
    text = "café 東京 😀 naïve"
    # Byte-level ids for each character: multi-byte characters arrive as several tokens.
    ids = [i for ch in text for i in tok.encode(ch, add_special_tokens=False)]
    assert len(ids) > len(text) - 3  # the emoji and CJK really are split across tokens
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.add(i) for i in ids] + [detok.flush()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def test_stop_string_across_pieces_is_not_emitted():
    f = StopStringFilter(["</end>", "STOP"])
    out = [f.feed(p) for p in ["hello </e", "n", "d> more"]]
    assert "".join(out) == "hello "
    assert f.stopped and f.feed("x") == ""


def test_partial_stop_prefix_is_released_at_the_end():
    f = StopStringFilter(["STOP"])
    out = "".join(f.feed(p) for p in ["ab", "ST", "O"]) + f.flush()
    assert out == "abSTO" and not f.stopped


def test_no_stop_strings_passes_through():
    f = StopStringFilter([])
    assert f.feed("abc") == "abc"


def test_seeded_sampling_is_reproducible_and_greedy_is_argmax():
    logits = torch.randn(100, generator=torch.Generator().manual_seed(0))
    p = SamplingParams(temperature=0.9, top_p=0.8, top_k=20, seed=7)
    a = [Sampler(p)(logits) for _ in range(3)]
    s1, s2 = Sampler(p), Sampler(p)
    assert [s1(logits) for _ in range(20)] == [s2(logits) for _ in range(20)]
    assert len(set(a)) == 1  # fresh samplers with the same seed start identically
    assert Sampler(SamplingParams(temperature=0.0))(logits) == int(torch.argmax(logits))


def test_top_k_and_top_p_restrict_the_support():
    logits = torch.tensor([5.0, 4.0, 1.0, 0.0, -1.0])
    s = Sampler(SamplingParams(temperature=1.0, top_k=2, seed=1))
    assert {s(logits) for _ in range(200)} <= {0, 1}
    s = Sampler(SamplingParams(temperature=1.0, top_p=0.5, seed=1))
    assert {s(logits) for _ in range(200)} == {0}

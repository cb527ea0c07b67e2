"""Prompt tokenization from an earlier prompt's ids must equal tokenizing the whole text, always."""

import json
import random

import pytest
from tokenizers import Tokenizer, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from hyserve.prompt import tokens as prompt_tokens
from hyserve.prompt.tokens import PrefixEncoder
from hyserve.testing.tiny import CHATML_TEMPLATE, train_tokenizer

QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer()


def _variant(tok, normalizer=None, pre_tokenizer=None, edit=None):
    """The tiny tokenizer with another normalizer / pre-tokenizer / added-token flags."""
    backend = Tokenizer.from_str(tok.backend_tokenizer.to_str())
    if normalizer is not None:
        backend.normalizer = normalizer
    if pre_tokenizer is not None:
        backend.pre_tokenizer = pre_tokenizer
    if edit is not None:
        config = json.loads(backend.to_str())
        edit(config)
        backend = Tokenizer.from_str(json.dumps(config))
    fast = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHATML_TEMPLATE
    return fast


_CONTENT = [
    "Hello, world!",
    "  leading and trailing spaces  ",
    "tabs\tand\nnewlines\n\n",
    "naïve café 東京 😀",
    "numbers 12345 67.89",
    "code: def f(x):\n    return x * 2\n",
    "a <|im_start|> inside user text",
    "ends with a newline\n",
    "",
    "repeat " * 30,
    "<|im_end|>",
    "x",
]


def _conversations(seed: int, n: int = 12):
    """Random multi-turn chats with edits of earlier turns and regenerations (branching histories)."""
    rng = random.Random(seed)
    for _ in range(n):
        msgs = [{"role": "system", "content": rng.choice(_CONTENT)}]
        for _ in range(rng.randint(1, 6)):
            msgs.append({"role": "user", "content": " ".join(rng.choice(_CONTENT) for _ in range(rng.randint(1, 4)))})
            yield list(msgs)
            if rng.random() < 0.3 and len(msgs) > 2:  # edit an earlier user message: the history branches
                i = rng.randrange(1, len(msgs))
                msgs[i] = {"role": msgs[i]["role"], "content": msgs[i]["content"] + " (edited)"}
                yield list(msgs)
            msgs.append({"role": "assistant", "content": rng.choice(_CONTENT)})


def _check_equal(tok, encoder, seed):
    checked = 0
    for msgs in _conversations(seed):
        texts = [tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=g) for g in (True, False)]
        want = [list(ids) for ids in tok(texts, add_special_tokens=False)["input_ids"]]
        assert encoder.encode_many(texts) == want
        checked += 1
    return checked


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_reuse_equals_a_full_encode_on_branching_chats(tokenizer, seed):
    encoder = PrefixEncoder(tokenizer, capacity=8)
    assert encoder.enabled, encoder.reason
    assert _check_equal(tokenizer, encoder, seed) > 20
    assert encoder.reused_tokens > 0  # the comparison above went through the reuse path


def test_reuse_with_a_qwen_style_split_and_nfc(tokenizer):
    tok = _variant(
        tokenizer,
        normalizers.NFC(),
        pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(QWEN_SPLIT, behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        ),
    )
    encoder = PrefixEncoder(tok)
    assert encoder.enabled, encoder.reason
    _check_equal(tok, encoder, 3)
    assert encoder.reused_tokens > 0


def test_a_long_history_is_not_tokenized_again(tokenizer):
    encoder = PrefixEncoder(tokenizer)
    msgs = [{"role": "system", "content": "sys"}, {"role": "user", "content": "word " * 600}]
    first = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    encoder.encode(first)
    msgs += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "and then?"}]
    second = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    before = encoder.reused_tokens
    assert encoder.encode(second) == list(tokenizer(second, add_special_tokens=False)["input_ids"])
    assert encoder.reused_tokens - before >= len(encoder.encode(first)) - 8  # all of turn 1 but its tail


@pytest.mark.parametrize("kind", ["metaspace", "lstrip", "unknown_normalizer"])
def test_pipelines_it_cannot_prove_fall_back_to_full_encodes(tokenizer, kind):
    if kind == "metaspace":
        tok = _variant(tokenizer, pre_tokenizer=pre_tokenizers.Metaspace())
    elif kind == "lstrip":

        def edit(config):
            for t in config["added_tokens"]:
                t["lstrip"] = True

        tok = _variant(tokenizer, edit=edit)
    else:
        tok = _variant(tokenizer, normalizer=normalizers.Prepend("_"))
    encoder = PrefixEncoder(tok)
    assert not encoder.enabled and encoder.reason
    _check_equal(tok, encoder, 4)  # still correct: every text is tokenized in full
    assert encoder.reused_tokens == 0


def test_a_mismatch_turns_the_reuse_off_and_returns_the_full_encode(tokenizer, monkeypatch):
    encoder = PrefixEncoder(tokenizer)
    monkeypatch.setattr(prompt_tokens, "VERIFY_EVERY", 1)
    real = encoder._reference
    monkeypatch.setattr(encoder, "_reference", lambda text: real(text) + [7])  # a "different" tokenizer
    msgs = [{"role": "system", "content": "sys"}, {"role": "user", "content": "hello there, " * 20}]
    a = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=False)
    encoder.encode(a)
    b = a + "<|im_start|>user\nmore<|im_end|>\n"
    assert encoder.encode(b) == real(b) + [7]  # the reference wins
    assert encoder.reused_tokens > 0
    assert not encoder.enabled and "mismatch" in encoder.reason


def test_entries_are_namespaced_by_salt(tokenizer):
    """Tenant B tokenizing tenant A's text does not reuse A's entry (it would answer measurably faster)."""
    encoder = PrefixEncoder(tokenizer)
    msgs = [{"role": "system", "content": "sys"}, {"role": "user", "content": "a private document " * 50}]
    first = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    encoder.encode(first, salt="a")
    msgs += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}]
    second = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    want = list(tokenizer(second, add_special_tokens=False)["input_ids"])
    assert encoder.encode(first, salt="b") == encoder.encode(first, salt="a")
    assert encoder.hits == 1  # only tenant a's repeat
    assert encoder.encode(second, salt="c") == want and encoder.reused_tokens == 0
    assert encoder.encode(second, salt="a") == want and encoder.reused_tokens > 0

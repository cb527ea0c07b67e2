"""A prompt that cannot fit is refused from its length, before any tokenization, and leaves nothing behind."""

import random

import pytest
from tokenizers import normalizers, pre_tokenizers

from hyserve.prompt.bound import PromptTooLong, max_chars_per_token
from hyserve.prompt.tokens import PrefixEncoder
from hyserve.testing.tiny import train_tokenizer

from .test_prompt_tokens import QWEN_SPLIT, _variant


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer()


class Spy:
    """Counts the texts a real PrefixEncoder is asked to tokenize."""

    def __init__(self, encoder: PrefixEncoder):
        self.encoder, self.texts = encoder, 0
        self.real = encoder.encode_many

    def __enter__(self):
        def counting(texts, *args, **kwargs):
            self.texts += len(texts)
            return self.real(texts, *args, **kwargs)

        self.encoder.encode_many = counting
        return self

    def __exit__(self, *exc):
        del self.encoder.encode_many


def test_the_bound_is_the_longest_token_and_holds_on_dense_texts(tokenizer):
    n = max_chars_per_token(tokenizer)
    assert n == max(len(t) for t in tokenizer.get_vocab())
    rng = random.Random(0)
    vocab = tokenizer.get_vocab()
    longest = sorted((t for t in vocab if not t.startswith("<|")), key=len)[-40:]  # the densest text there is
    for _ in range(50):
        text = tokenizer.decode([vocab[rng.choice(longest)] for _ in range(rng.randint(1, 200))])
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert len(ids) * n >= len(text)


def test_a_composing_normalizer_widens_it_and_lossy_pipelines_have_none(tokenizer):
    n = max_chars_per_token(tokenizer)
    nfc = _variant(
        tokenizer,
        normalizers.NFC(),
        pre_tokenizers.Sequence(
            [pre_tokenizers.Split(QWEN_SPLIT, behavior="isolated"), pre_tokenizers.ByteLevel(use_regex=False)]
        ),
    )
    assert max_chars_per_token(nfc) == 4 * n
    assert max_chars_per_token(_variant(tokenizer, normalizers.Strip())) is None
    assert max_chars_per_token(_variant(tokenizer, pre_tokenizer=pre_tokenizers.Whitespace())) is None
    assert (
        max_chars_per_token(
            _variant(
                tokenizer,
                pre_tokenizer=pre_tokenizers.Sequence(
                    [pre_tokenizers.Split(" ", behavior="removed"), pre_tokenizers.ByteLevel()]
                ),
            )
        )
        is None
    )

    def lstrip(config):
        config["added_tokens"][0]["lstrip"] = True

    assert max_chars_per_token(_variant(tokenizer, edit=lstrip)) is None


def test_a_prompt_over_the_bound_is_refused_without_tokenizing(runtimes):
    rt = runtimes("qwen3_5")
    limit = rt.chars_per_token * (rt.max_model_len - 1)
    huge = [{"role": "user", "content": "x" * (limit + 1)}]
    with Spy(rt.prompt_encoder) as spy:
        with pytest.raises(PromptTooLong, match="maximum context length"):
            rt.render_chat(huge, True)
        with pytest.raises(PromptTooLong):
            rt.encode("y" * (limit + 1))
        assert isinstance(rt.render_many([(huge, False)])[0], PromptTooLong)  # a boundary render: in its place
    assert spy.texts == 0
    small = [{"role": "user", "content": "hello there"}]
    assert (
        rt.render_chat(small, True)
        == rt.tokenizer(
            rt.tokenizer.apply_chat_template(small, tokenize=False, add_generation_prompt=True),
            add_special_tokens=False,
        )["input_ids"]
    )


def test_texts_the_context_cannot_hold_are_not_kept(tokenizer):
    encoder = PrefixEncoder(tokenizer)
    text = "<|im_start|>user\n" + "word " * 400 + "<|im_end|>\n"
    n = len(encoder.encode(text, keep_below=10))
    assert n > 10 and encoder.hits == 0
    encoder.encode(text, keep_below=10)
    assert encoder.hits == 0  # nothing was kept to hit
    encoder.encode(text, keep_below=n + 1)
    encoder.encode(text, keep_below=n + 1)
    assert encoder.hits == 1

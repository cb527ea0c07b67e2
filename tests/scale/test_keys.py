"""The routing process's prompt keys, without Ray: a prompt that cannot fit is refused from its length before
any tokenizing (as a replica refuses it), and the texts kept for reuse stay within their byte cap."""

import json

import pytest

from hyserve.scale.keys import PromptKeys
from hyserve.service import ServiceConfig

HUGE = "word " * ((7 << 20) // 5)  # ~7 MB: millions of tokens, far over the tiny model's 4096


@pytest.fixture(scope="module")
def keys(model_dirs):
    return PromptKeys(ServiceConfig(model_dir=model_dirs["qwen3_5"], device="cpu"))


@pytest.fixture
def tokenizing(keys, monkeypatch):
    """Counts the texts handed to the tokenizer's backend."""
    seen = []
    backend = keys.runtime.prompt_encoder._backend
    real = backend.encode_batch
    monkeypatch.setattr(
        keys.runtime.prompt_encoder,
        "_backend",
        type(
            "Spy",
            (),
            {
                "encode_batch": lambda self, texts, **kw: seen.extend(texts) or real(texts, **kw),
                "to_str": backend.to_str,
            },
        )(),
    )
    return seen


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/completions", {"model": "m", "prompt": HUGE}),
        ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": HUGE}]}),
        ("/v1/completions", {"model": "m", "prompt": [1] * 5000}),
    ],
    ids=["completion", "chat", "token-ids"],
)
def test_a_prompt_over_the_context_is_not_tokenized(keys, tokenizing, path, body):
    assert keys.runtime.max_model_len == 4096  # the model's context, not an unbounded one
    assert keys.of(path, [], json.dumps(body).encode()) == ("", None)  # routed by load; the replica refuses it
    assert tokenizing == []


def test_a_prompt_that_fits_is_keyed(keys, tokenizing):
    salt, tokens = keys.of("/v1/completions", [], json.dumps({"model": "m", "prompt": "hello there"}).encode())
    assert tokens == keys.runtime.tokenizer("hello there", add_special_tokens=False)["input_ids"]
    assert tokenizing == ["hello there"]


def test_the_kept_texts_stay_within_their_byte_cap(keys):
    encoder = keys.runtime.prompt_encoder
    cap = encoder.max_bytes
    encoder.max_bytes = 200_000
    try:
        for i in range(40):
            text = f"<|im_start|>user\n{i} " + "some words to keep " * 500
            assert encoder.encode(text, "s") == keys.runtime.tokenizer(text, add_special_tokens=False)["input_ids"]
            assert 0 < encoder.bytes <= encoder.max_bytes
        assert len(encoder._entries) < 40
        encoder.encode("x" * 300_000)  # bigger than the cap alone: not kept
        assert 0 < encoder.bytes <= encoder.max_bytes
    finally:
        encoder.max_bytes = cap


@pytest.fixture(scope="module")
def keyed(model_dirs):
    return PromptKeys(ServiceConfig(model_dir=model_dirs["qwen3_5"], device="cpu", api_keys=("key-a",)))


@pytest.mark.parametrize(
    "auth",
    [[], [(b"authorization", b"Bearer wrong")], [(b"x-api-key", b"key-b")]],
    ids=["none", "wrong", "unknown-x-api-key"],
)
def test_a_request_without_a_valid_key_is_not_rendered(keyed, auth):
    """The key is checked first: an unauthenticated body is neither parsed nor tokenized (the replica refuses
    it), whatever it holds."""
    spy = []
    real = keyed.runtime.prompt_encoder.encode
    keyed.runtime.prompt_encoder.encode = lambda *a, **kw: spy.append(a) or real(*a, **kw)
    try:
        body = json.dumps({"model": "m", "prompt": "hello there"}).encode()
        assert keyed.admitted(auth) == (False, None)
        assert keyed.of("/v1/completions", auth, body) == ("", None)
        assert keyed.of("/v1/chat/completions", auth, b"{not json") == ("", None)
        salt, tokens = keyed.of("/v1/completions", [(b"authorization", b"Bearer key-a")], body)
        assert tokens == keyed.runtime.tokenizer("hello there", add_special_tokens=False)["input_ids"] and salt
        assert len(spy) == 1  # the keyed request's only
    finally:
        del keyed.runtime.prompt_encoder.encode

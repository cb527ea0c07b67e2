"""`n` > 1 through the real `openai` client: n choices from one prefill, choice i sampled with seed + i."""

import pytest
from openai import BadRequestError, OpenAI

from hyserve.server.run import BackgroundServer

from ..conftest import wait_idle

MODEL = "tiny-qwen3_5"
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def off(make_service):
    """Cache off: every prompt token a request needs is prefilled by it, so the counter shows sharing."""
    with BackgroundServer(make_service("qwen3_5", cache_enabled=False)) as srv:
        yield srv


def client(srv) -> OpenAI:
    return OpenAI(base_url=f"{srv.base_url}/v1", api_key="unused", max_retries=0)


def prefilled(srv) -> float:
    return srv.service.metrics.prefill_tokens._value.get()


def test_n_choices_share_one_prefill_and_each_has_its_seed(off, qwen35_server):
    rt = off.service.runtime
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1.0, extra_body={"return_token_ids": True})
    before = prefilled(off)
    resp = client(off).completions.create(n=3, seed=7, **kw)
    assert prefilled(off) - before == len(rt.encode(PROMPT))  # one prefill for the three choices
    assert [c.index for c in resp.choices] == [0, 1, 2]
    ids = [c.model_extra["token_ids"] for c in resp.choices]
    for i, got in enumerate(ids):  # choice i is the n=1 request with seed 7 + i, cache off and on
        for srv in (off, qwen35_server):
            alone = client(srv).completions.create(seed=7 + i, **kw).choices[0]
            assert alone.model_extra["token_ids"] == got and alone.text == resp.choices[i].text
            wait_idle(srv.service)
    assert len({tuple(t) for t in ids}) > 1  # different seeds, different samples on this model
    assert resp.usage.completion_tokens == sum(map(len, ids))
    assert resp.usage.prompt_tokens == len(rt.encode(PROMPT))


def test_chat_n_streams_each_choice_and_usage_once(qwen35_server):
    c = client(qwen35_server)
    kw = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Tell me a story."}],
        max_tokens=6,
        temperature=0.8,
        seed=3,
        n=2,
    )
    whole = c.chat.completions.create(**kw)
    texts, usages, finishes = ["", ""], [], [None, None]
    for chunk in c.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
        if chunk.usage:
            usages.append(chunk.usage)
        for ch in chunk.choices:
            texts[ch.index] += ch.delta.content or ""
            finishes[ch.index] = ch.finish_reason or finishes[ch.index]
    assert texts == [ch.message.content for ch in whole.choices]
    assert finishes == [ch.finish_reason for ch in whole.choices]
    assert len(usages) == 1 and usages[0].completion_tokens == whole.usage.completion_tokens


def test_greedy_n_equals_n1_and_limits(qwen35_server):
    c = client(qwen35_server)
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0)
    one = c.completions.create(**kw).choices[0].text
    assert [ch.text for ch in c.completions.create(n=4, **kw).choices] == [one] * 4
    with pytest.raises(BadRequestError) as err:
        c.completions.create(n=17, **kw)
    assert err.value.body["param"] == "n"


@pytest.mark.parametrize("arch", ["mamba2", "qwen3"])
def test_forked_choices_equal_separate_requests_on_other_families(servers, arch):
    """The copied state is exact for pure-recurrent and attention-only models too."""
    c = client(servers(arch))
    kw = dict(model=f"tiny-{arch}", prompt=PROMPT, max_tokens=6, temperature=1.0)
    both = c.completions.create(n=2, seed=21, **kw).choices
    assert [ch.text for ch in both] == [c.completions.create(seed=21 + i, **kw).choices[0].text for i in range(2)]

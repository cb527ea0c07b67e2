"""logit_bias, penalties, min_tokens, stop_token_ids and logprobs through the real `openai` client, against
transformers' own generate as the reference, with the prefix cache and speculation on and off."""

import pytest
import torch
from openai import BadRequestError, OpenAI
from transformers import LogitsProcessor, LogitsProcessorList

from hyserve.engine.speculative import SpeculativeConfig
from hyserve.server.run import BackgroundServer

from ..conftest import wait_idle

MODEL = "tiny-qwen3_5"
PROMPT = "The quick brown fox"  # greedy falls into a loop on the tiny model: penalties change it


def client(srv) -> OpenAI:
    return OpenAI(base_url=f"{srv.base_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def pair(make_service):
    """(cache + speculation on, cache off) servers on the same tiny Qwen3.5 model."""
    on = BackgroundServer(make_service("qwen3_5", speculative=SpeculativeConfig(num_tokens=4, ngram=2))).__enter__()
    off = BackgroundServer(make_service("qwen3_5", cache_enabled=False)).__enter__()
    yield on, off
    on.__exit__(None, None, None)
    off.__exit__(None, None, None)


class OpenAIPenalties(LogitsProcessor):
    """Reference presence / frequency penalties over the generated part of input_ids (OpenAI's formula)."""

    def __init__(self, start, presence, frequency):
        self.start, self.presence, self.frequency = start, presence, frequency

    def __call__(self, input_ids, scores):
        for token, count in zip(*torch.unique(input_ids[0, self.start :], return_counts=True)):
            scores[0, token] -= self.presence + self.frequency * count
        return scores


def completion_ids(srv, **kw):
    kw.setdefault("temperature", 0)
    resp = client(srv).completions.create(
        model=MODEL, prompt=PROMPT, extra_body={"return_token_ids": True, **kw.pop("extra", {})}, **kw
    )
    return resp.choices[0].model_extra["token_ids"], resp


def hf(rt, n, **kw):
    prompt = rt.encode(PROMPT)
    out = rt.model.generate(
        torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=rt.tokenizer.pad_token_id, **kw
    )
    ids = out[0, len(prompt) :].tolist()
    eos = [i for i, t in enumerate(ids) if t in rt.eos_token_ids]
    return ids[: eos[0] + 1] if eos else ids


def test_penalties_equal_transformers_with_cache_and_speculation(pair):
    on, off = pair
    rt = on.service.runtime
    plain, _ = completion_ids(on, max_tokens=16)
    assert plain == hf(rt, 16)
    want = hf(rt, 16, repetition_penalty=1.5)
    assert want != plain  # the penalty matters on this prompt, so the comparison below can fail
    for srv in (on, on, off):  # the second request on `on` starts from the cached prompt
        assert completion_ids(srv, max_tokens=16, extra={"repetition_penalty": 1.5})[0] == want
        wait_idle(srv.service)
    start = len(rt.encode(PROMPT))
    want = hf(rt, 16, logits_processor=LogitsProcessorList([OpenAIPenalties(start, 0.7, 1.3)]))
    assert want != plain
    for srv in (on, off):
        assert completion_ids(srv, max_tokens=16, presence_penalty=0.7, frequency_penalty=1.3)[0] == want


def test_logit_bias_stop_token_ids_and_min_tokens(pair):
    on, _ = pair
    rt = on.service.runtime
    plain, _ = completion_ids(on, max_tokens=8)
    banned, _ = completion_ids(on, max_tokens=8, logit_bias={str(plain[0]): -100})
    assert banned[0] != plain[0]
    forced, _ = completion_ids(on, max_tokens=5, logit_bias={"42": 100})
    assert forced == [42] * 5

    stop = next(i for i, t in enumerate(plain) if i > 0 and t not in plain[:i])  # first occurrence of a token
    ids, resp = completion_ids(on, max_tokens=8, extra={"stop_token_ids": [plain[stop]]})
    assert ids == plain[: stop + 1] and resp.choices[0].finish_reason == "stop"

    eos = min(rt.eos_token_ids)
    ids, _ = completion_ids(on, max_tokens=8, logit_bias={str(eos): 100})
    assert ids == [eos]
    ids, resp = completion_ids(on, max_tokens=8, logit_bias={str(eos): 100}, extra={"min_tokens": 3})
    assert len(ids) == 4 and ids[-1] == eos and eos not in ids[:3] and resp.choices[0].finish_reason == "stop"


def test_seeded_sampling_with_penalties_is_reproducible_under_concurrency(pair):
    from concurrent.futures import ThreadPoolExecutor

    on, _ = pair
    kw = dict(max_tokens=12, temperature=1.0, seed=5, frequency_penalty=0.5, logit_bias={"7": 5})
    alone = completion_ids(on, **kw)[0]
    with ThreadPoolExecutor(3) as pool:  # the same request batched with others
        runs = list(pool.map(lambda s: completion_ids(on, **{**kw, "seed": s})[0], [5, 6, 5]))
    assert runs[0] == runs[2] == alone


def test_chat_logprobs_match_the_model_and_stream_the_same(pair):
    on, off = pair
    rt = on.service.runtime
    messages = [{"role": "user", "content": "Say something."}]
    kw = dict(model=MODEL, messages=messages, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3)
    resp = client(on).chat.completions.create(**kw, extra_body={"return_token_ids": True})
    ids, content = resp.choices[0].model_extra["token_ids"], resp.choices[0].logprobs.content
    assert len(content) == len(ids) == resp.usage.completion_tokens
    prompt = rt.render_chat(messages, True)
    with torch.no_grad():
        ref = torch.log_softmax(rt.model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 :].float(), -1)
    for i, (tid, entry) in enumerate(zip(ids, content)):
        assert entry.token == rt.tokenizer.decode([tid]) and entry.bytes == list(entry.token.encode())
        assert abs(entry.logprob - ref[i, tid].item()) < 1e-3
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].token == entry.token  # greedy: the best
        assert abs(entry.top_logprobs[1].logprob - ref[i].topk(3).values[1].item()) < 1e-3

    streamed = []
    for chunk in client(on).chat.completions.create(**kw, stream=True):
        for ch in chunk.choices:
            streamed += ch.logprobs.content if ch.logprobs else []
    other = client(off).chat.completions.create(**kw).choices[0].logprobs.content
    for run in (streamed, other):  # same tokens; logprobs equal up to float noise (cached prefix or not)
        assert [e.token for e in run] == [e.token for e in content]
        assert [[t.token for t in e.top_logprobs] for e in run] == [[t.token for t in e.top_logprobs] for e in content]
        assert all(abs(a.logprob - b.logprob) < 1e-4 for a, b in zip(run, content))


def test_completion_logprobs_and_echo(pair):
    on, _ = pair
    c = client(on)
    resp = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2)
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == resp.usage.completion_tokens
    assert "".join(lp.tokens).startswith(resp.choices[0].text) or resp.choices[0].finish_reason == "stop"
    assert all(max(top.values()) == got for top, got in zip(lp.top_logprobs, lp.token_logprobs))  # greedy
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])

    plain = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0).choices[0].text
    echoed = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, echo=True)
    assert echoed.choices[0].text == PROMPT + plain
    parts = [
        ch.choices[0].text
        for ch in c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, echo=True, stream=True)
        if ch.choices
    ]
    assert "".join(parts) == PROMPT + plain


@pytest.mark.parametrize(
    "kw, param",
    [
        (dict(logit_bias={"99999999": 1}), "logit_bias"),
        (dict(logit_bias={"abc": 1}), "logit_bias"),
        (dict(logit_bias={"5": 101}), "logit_bias"),
        (dict(extra_body={"stop_token_ids": [-1]}), "stop_token_ids"),
        (dict(extra_body={"min_tokens": 50}), "min_tokens"),
        (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(logprobs=True, top_logprobs=21), "top_logprobs"),
        (dict(top_logprobs=2), "top_logprobs"),
    ],
)
def test_bad_fields_are_400s_naming_the_field(pair, kw, param):
    with pytest.raises(BadRequestError) as err:
        client(pair[0]).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, **kw
        )
    assert err.value.body["param"] == param


def test_completion_bad_logprobs_and_echo_with_logprobs(pair):
    c = client(pair[0])
    for kw, param in [(dict(logprobs=21), "logprobs"), (dict(logprobs=1, echo=True), "echo")]:
        with pytest.raises(BadRequestError) as err:
            c.completions.create(model=MODEL, prompt="hi", max_tokens=2, **kw)
        assert err.value.body["param"] == param

"""/tokenize, /detokenize (vLLM's shapes) and /v1/models' max_model_len: counts equal what the generation
routes report as usage.prompt_tokens for the same input."""

import httpx
import pytest
from openai import OpenAI

from hyserve.server.run import BackgroundServer

MODEL = "tiny-qwen3_5"


@pytest.fixture(scope="module")
def keyed(make_service):
    with BackgroundServer(make_service("qwen3_5", api_keys=("k1",))) as srv:
        yield srv


def post(srv, path, body, key="k1"):
    return httpx.post(f"{srv.base_url}{path}", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=30)


def test_counts_equal_generation_usage_and_round_trip(keyed):
    c = OpenAI(base_url=f"{keyed.base_url}/v1", api_key="k1", max_retries=0)
    prompt = "The quick brown fox jumps"
    got = post(keyed, "/tokenize", {"model": MODEL, "prompt": prompt, "return_token_strs": True}).json()
    usage = c.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0).usage
    assert got["count"] == len(got["tokens"]) == usage.prompt_tokens
    assert got["max_model_len"] == keyed.service.runtime.max_model_len
    assert len(got["token_strs"]) == got["count"]
    assert post(keyed, "/detokenize", {"model": MODEL, "tokens": got["tokens"]}).json() == {"prompt": prompt}

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    chat = post(keyed, "/tokenize", {"messages": messages}).json()
    usage = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, temperature=0).usage
    assert chat["count"] == usage.prompt_tokens and "token_strs" not in chat
    no_gen = post(keyed, "/tokenize", {"messages": messages, "add_generation_prompt": False}).json()
    assert no_gen["count"] < chat["count"] and chat["tokens"][: no_gen["count"]] == no_gen["tokens"]

    models = c.models.list().data
    assert models[0].id == MODEL and models[0].model_extra["max_model_len"] == keyed.service.runtime.max_model_len


def test_errors_and_api_key(keyed):
    for path, body, status, param in [
        ("/detokenize", {"tokens": [10**9]}, 400, "tokens"),
        ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
        ("/tokenize", {}, 400, "prompt"),
        ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, 400, "prompt"),
        ("/tokenize", {"model": "other", "prompt": "a"}, 404, "model"),
        (
            "/tokenize",
            {"messages": [{"role": "user", "content": "b"}], "add_special_tokens": True},
            400,
            "add_special_tokens",
        ),
    ]:
        r = post(keyed, path, body)
        assert (r.status_code, r.json()["error"]["param"]) == (status, param), (path, body, r.text)
    for path, body in [("/tokenize", {"prompt": "a"}), ("/detokenize", {"tokens": [1]})]:
        assert post(keyed, path, body, key="wrong").status_code == 401
        assert post(keyed, path, body).status_code == 200

"""Bad input gets an OpenAI error body with the right status, and never touches the cache."""

import json

import httpx
import pytest

from ..conftest import wait_idle

MODEL = "tiny-qwen3_5"
OK_MSGS = [{"role": "user", "content": "hi"}]


def post(srv, path, body, raw=None):
    kw = {"content": raw, "headers": {"content-type": "application/json"}} if raw is not None else {"json": body}
    return httpx.post(f"{srv.base_url}{path}", timeout=30, **kw)


def assert_error(resp, status, param=None, code=None):
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"] and "Traceback" not in err["message"]
    if param is not None:
        assert err["param"] == param
    if code is not None:
        assert err["code"] == code
    return err


CASES = [
    (
        "malformed json",
        "/v1/chat/completions",
        None,
        '{"model": "tiny-qwen3_5", "messages": [',
        400,
        None,
        "invalid_json",
    ),
    ("body not an object", "/v1/chat/completions", [1, 2], None, 400, None, None),
    ("missing messages", "/v1/chat/completions", {"model": MODEL}, None, 400, "messages", "missing"),
    ("empty messages", "/v1/chat/completions", {"model": MODEL, "messages": []}, None, 400, "messages", None),
    ("messages wrong type", "/v1/chat/completions", {"model": MODEL, "messages": "hi"}, None, 400, "messages", None),
    (
        "bad role",
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]},
        None,
        400,
        "messages.0.role",
        None,
    ),
    (
        "max_tokens zero",
        "/v1/chat/completions",
        {"model": MODEL, "messages": OK_MSGS, "max_tokens": 0},
        None,
        400,
        "max_tokens",
        None,
    ),
    (
        "max_tokens wrong type",
        "/v1/chat/completions",
        {"model": MODEL, "messages": OK_MSGS, "max_tokens": "many"},
        None,
        400,
        "max_tokens",
        None,
    ),
    (
        "negative temperature",
        "/v1/chat/completions",
        {"model": MODEL, "messages": OK_MSGS, "temperature": -0.5},
        None,
        400,
        "temperature",
        None,
    ),
    ("top_p zero", "/v1/chat/completions", {"model": MODEL, "messages": OK_MSGS, "top_p": 0}, None, 400, "top_p", None),
    (
        "too many stops",
        "/v1/chat/completions",
        {"model": MODEL, "messages": OK_MSGS, "stop": list("abcde")},
        None,
        400,
        "stop",
        None,
    ),
    ("n > 16", "/v1/chat/completions", {"model": MODEL, "messages": OK_MSGS, "n": 17}, None, 400, "n", None),
    (
        "unknown model",
        "/v1/chat/completions",
        {"model": "gpt-9", "messages": OK_MSGS},
        None,
        404,
        "model",
        "model_not_found",
    ),
    (
        "completion unknown model",
        "/v1/completions",
        {"model": "gpt-9", "prompt": "x"},
        None,
        404,
        "model",
        "model_not_found",
    ),
    ("completion empty prompt", "/v1/completions", {"model": MODEL, "prompt": ""}, None, 400, "prompt", None),
    (
        "completion token out of range",
        "/v1/completions",
        {"model": MODEL, "prompt": [1, 10**9]},
        None,
        400,
        "prompt",
        None,
    ),
    (
        "over context: max_tokens",
        "/v1/chat/completions",
        {"model": MODEL, "messages": OK_MSGS, "max_tokens": 4096},
        None,
        400,
        "messages",
        "context_length_exceeded",
    ),
    (
        "over context: prompt",
        "/v1/completions",
        {"model": MODEL, "prompt": "dog " * 5000},
        None,
        400,
        "prompt",
        "context_length_exceeded",
    ),
    # every field's real domain, refused at the HTTP layer instead of failing in the engine
    ("seed over 2**64-1", "/v1/completions", {"model": MODEL, "prompt": "x", "seed": 2**64}, None, 400, "seed", None),
    (
        "seed under -2**63",
        "/v1/completions",
        {"model": MODEL, "prompt": "x", "seed": -(2**63) - 1},
        None,
        400,
        "seed",
        None,
    ),
    (
        "seed a float",
        "/v1/chat/completions",
        {"model": MODEL, "messages": OK_MSGS, "seed": 1.5},
        None,
        400,
        "seed",
        None,
    ),
    (
        "temperature NaN",
        "/v1/completions",
        None,
        '{"model": "tiny-qwen3_5", "prompt": "x", "temperature": NaN}',
        400,
        "temperature",
        None,
    ),
    (
        "temperature Infinity",
        "/v1/completions",
        None,
        '{"model": "tiny-qwen3_5", "prompt": "x", "temperature": Infinity}',
        400,
        "temperature",
        None,
    ),
    (
        "temperature over 2",
        "/v1/completions",
        {"model": MODEL, "prompt": "x", "temperature": 2.5},
        None,
        400,
        "temperature",
        None,
    ),
    (
        "top_p NaN",
        "/v1/completions",
        None,
        '{"model": "tiny-qwen3_5", "prompt": "x", "top_p": NaN}',
        400,
        "top_p",
        None,
    ),
    ("top_p over 1", "/v1/completions", {"model": MODEL, "prompt": "x", "top_p": 1.5}, None, 400, "top_p", None),
    ("top_k under -1", "/v1/completions", {"model": MODEL, "prompt": "x", "top_k": -2}, None, 400, "top_k", None),
    ("top_k over int32", "/v1/completions", {"model": MODEL, "prompt": "x", "top_k": 2**31}, None, 400, "top_k", None),
    (
        "max_tokens negative",
        "/v1/completions",
        {"model": MODEL, "prompt": "x", "max_tokens": -1},
        None,
        400,
        "max_tokens",
        None,
    ),
    (
        "max_completion_tokens zero",
        "/v1/chat/completions",
        {"model": MODEL, "messages": OK_MSGS, "max_completion_tokens": 0},
        None,
        400,
        "max_completion_tokens",
        None,
    ),
    (
        "cache_salt too long",
        "/v1/completions",
        {"model": MODEL, "prompt": "x", "cache_salt": "s" * 257},
        None,
        400,
        "cache_salt",
        None,
    ),
    ("empty stop string", "/v1/completions", {"model": MODEL, "prompt": "x", "stop": [""]}, None, 400, "stop", None),
    # a lone UTF-16 surrogate, wherever it is, is a 400 naming the field (it would fail the tokenizer or the reply)
    ("surrogate: model", "/v1/completions", None, '{"model": "\\ud800", "prompt": "x"}', 400, "model", None),
    (
        "surrogate: prompt",
        "/v1/completions",
        None,
        '{"model": "tiny-qwen3_5", "prompt": "hi \\ud800"}',
        400,
        "prompt",
        None,
    ),
    (
        "surrogate: low alone",
        "/v1/completions",
        None,
        '{"model": "tiny-qwen3_5", "prompt": "\\udc00 hi"}',
        400,
        "prompt",
        None,
    ),
    (
        "surrogate: message",
        "/v1/chat/completions",
        None,
        '{"model": "tiny-qwen3_5", "messages": [{"role": "user", "content": "a\\udfffb"}]}',
        400,
        "messages.0.content",
        None,
    ),
    (
        "surrogate: text part",
        "/v1/chat/completions",
        None,
        '{"model": "tiny-qwen3_5", "messages": [{"role": "user", "content": [{"type": "text", "text": "\\uDBFF"}]}]}',
        400,
        "messages.0.content.0.text",
        None,
    ),
    (
        "surrogate: stop",
        "/v1/completions",
        None,
        '{"model": "tiny-qwen3_5", "prompt": "x", "stop": ["a", "\\ud9ab"]}',
        400,
        "stop.1",
        None,
    ),
    (
        "surrogate: unknown field",
        "/v1/completions",
        None,
        '{"model": "tiny-qwen3_5", "prompt": "x", "user": "\\ud800"}',
        400,
        "user",
        None,
    ),
    (
        "surrogate: a key",
        "/v1/completions",
        None,
        '{"model": "tiny-qwen3_5", "prompt": "x", "\\ud800": 1}',
        400,
        None,
        None,
    ),
]


@pytest.mark.parametrize("name,path,body,raw,status,param,code", CASES, ids=[c[0] for c in CASES])
def test_bad_input(qwen35_server, name, path, body, raw, status, param, code):
    before = httpx.get(f"{qwen35_server.base_url}/v1/cache").json()
    assert_error(post(qwen35_server, path, body, raw), status, param, code)
    after = httpx.get(f"{qwen35_server.base_url}/v1/cache").json()
    assert (after["entries"], after["bytes"], after["lookups"]) == (
        before["entries"],
        before["bytes"],
        before["lookups"],
    )


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": "x", "seed": 2**64 - 1},
        {"prompt": "x", "seed": -(2**63)},
        {"prompt": "x", "top_k": 2**31 - 1},
        {"prompt": "pair \U0001f600 and text"},  # json.dumps escapes it as a surrogate pair: one character, no error
    ],
)
def test_edges_of_each_domain_are_served(qwen35_server, body):
    raw = json.dumps({"model": MODEL, "max_tokens": 2, **body})
    r = post(qwen35_server, "/v1/completions", None, raw)
    assert r.status_code == 200, r.text


def test_a_temperature_that_would_underflow_decodes_greedily(qwen35_server):
    def text(t):
        r = post(
            qwen35_server,
            "/v1/completions",
            {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 6, "temperature": t, "return_token_ids": True},
        )
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["token_ids"]

    greedy = text(0)
    assert text(1e-39) == greedy and text(1e-6) == greedy


def test_unknown_route_is_an_openai_error(qwen35_server):
    assert_error(httpx.get(f"{qwen35_server.base_url}/v1/nope"), 404)


def _generated_total(srv) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{srv.base_url}/metrics").text
    fam = {f.name: f for f in text_string_to_metric_families(text)}
    return sum(s.value for s in fam["hyserve_generation_tokens"].samples if s.name.endswith("_total"))


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_stops_generation(qwen35_server, stream):
    srv = qwen35_server
    wait_idle(srv.service)
    start = _generated_total(srv)
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell me a long story"}],
        "max_tokens": 3000,
        "temperature": 0,
        "stream": stream,
    }
    if stream:
        with httpx.stream("POST", f"{srv.base_url}/v1/chat/completions", json=body, timeout=30) as r:
            for line in r.iter_lines():
                if (
                    line.startswith("data:")
                    and '"content"' in line
                    and json.loads(line[5:])["choices"][0]["delta"].get("content")
                ):
                    break  # got a token: now hang up
    else:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{srv.base_url}/v1/chat/completions", json=body, timeout=0.5)
    wait_idle(srv.service)
    generated = _generated_total(srv) - start
    assert 0 < generated < 3000
    events = httpx.get(f"{srv.base_url}/v1/cache/events").json()["events"]
    assert any(e["event"] == "declined" and e["reason"] == "cancelled" for e in events)
    # The server is healthy afterwards and the cache still serves a correct request.
    ok = post(srv, "/v1/chat/completions", {"model": MODEL, "messages": OK_MSGS, "max_tokens": 2})
    assert ok.status_code == 200

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
    ("malformed json", "/v1/chat/completions", None, '{"model": "tiny-qwen3_5", "messages": [', 400, None, "invalid_json"),
    ("body not an object", "/v1/chat/completions", [1, 2], None, 400, None, None),
    ("missing messages", "/v1/chat/completions", {"model": MODEL}, None, 400, "messages", "missing"),
    ("empty messages", "/v1/chat/completions", {"model": MODEL, "messages": []}, None, 400, "messages", None),
    ("messages wrong type", "/v1/chat/completions", {"model": MODEL, "messages": "hi"}, None, 400, "messages", None),
    ("bad role", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]},
     None, 400, "messages.0.role", None),
    ("max_tokens zero", "/v1/chat/completions", {"model": MODEL, "messages": OK_MSGS, "max_tokens": 0},
     None, 400, "max_tokens", None),
    ("max_tokens wrong type", "/v1/chat/completions", {"model": MODEL, "messages": OK_MSGS, "max_tokens": "many"},
     None, 400, "max_tokens", None),
    ("negative temperature", "/v1/chat/completions", {"model": MODEL, "messages": OK_MSGS, "temperature": -0.5},
     None, 400, "temperature", None),
    ("top_p zero", "/v1/chat/completions", {"model": MODEL, "messages": OK_MSGS, "top_p": 0}, None, 400, "top_p", None),
    ("too many stops", "/v1/chat/completions", {"model": MODEL, "messages": OK_MSGS, "stop": list("abcde")},
     None, 400, "stop", None),
    ("n > 1", "/v1/chat/completions", {"model": MODEL, "messages": OK_MSGS, "n": 2}, None, 400, "n", None),
    ("unknown model", "/v1/chat/completions", {"model": "gpt-9", "messages": OK_MSGS}, None, 404, "model",
     "model_not_found"),
    ("completion unknown model", "/v1/completions", {"model": "gpt-9", "prompt": "x"}, None, 404, "model",
     "model_not_found"),
    ("completion empty prompt", "/v1/completions", {"model": MODEL, "prompt": ""}, None, 400, "prompt", None),
    ("completion token out of range", "/v1/completions", {"model": MODEL, "prompt": [1, 10**9]}, None, 400,
     "prompt", None),
    ("over context: max_tokens", "/v1/chat/completions", {"model": MODEL, "messages": OK_MSGS, "max_tokens": 4096},
     None, 400, "messages", "context_length_exceeded"),
    ("over context: prompt", "/v1/completions", {"model": MODEL, "prompt": "dog " * 5000}, None, 400, "prompt",
     "context_length_exceeded"),
]


@pytest.mark.parametrize("name,path,body,raw,status,param,code", CASES, ids=[c[0] for c in CASES])
def test_bad_input(qwen35_server, name, path, body, raw, status, param, code):
    before = httpx.get(f"{qwen35_server.base_url}/v1/cache").json()
    assert_error(post(qwen35_server, path, body, raw), status, param, code)
    after = httpx.get(f"{qwen35_server.base_url}/v1/cache").json()
    assert (after["entries"], after["bytes"], after["lookups"]) == (before["entries"], before["bytes"],
                                                                     before["lookups"])


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
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a long story"}],
            "max_tokens": 3000, "temperature": 0, "stream": stream}
    if stream:
        with httpx.stream("POST", f"{srv.base_url}/v1/chat/completions", json=body, timeout=30) as r:
            for line in r.iter_lines():
                if line.startswith("data:") and '"content"' in line and json.loads(line[5:])["choices"][0]["delta"].get("content"):
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

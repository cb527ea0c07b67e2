"""Schema fuzzing of both completion endpoints: whatever the body, no 5xx, and every refusal is an OpenAI
error body. Bounded: FUZZ_EXAMPLES bodies per endpoint (env HYSERVE_FUZZ_EXAMPLES), each at most 8 tokens."""

import json
import os

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hyserve.server.run import BackgroundServer

from ..conftest import wait_idle

MODEL = "tiny-qwen3_5"
FUZZ_EXAMPLES = int(os.environ.get("HYSERVE_FUZZ_EXAMPLES", "400"))
SENT = {"bodies": 0, "2xx": 0, "4xx": 0}

# any text, lone surrogates included (JSON escapes them; Python decodes them into unencodable strings)
any_text = st.text(st.characters(codec=None, exclude_categories=()), max_size=12)
good_text = st.text(max_size=24)  # hypothesis' default: any character but a surrogate
scalars = st.none() | st.booleans() | st.integers() | st.floats() | any_text
junk = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(any_text, inner, max_size=3), max_leaves=6
)
big_ints = st.sampled_from([2**31 - 1, 2**31, 2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63), -(2**63) - 1, 10**30])
edge_floats = st.sampled_from([0.0, -0.0, 5e-324, 1e-39, 1e-6, 1e-5, 0.5, 1.0, 2.0])
bad_floats = st.floats() | st.sampled_from([-1e-39, 2.0000001, 1e308, float("nan"), float("inf")])

# Each field: values in its domain (edges included), and values outside it.
GOOD = {
    "max_tokens": st.integers(1, 8),
    "temperature": edge_floats | st.floats(0, 2) | st.floats(0, 1e-30),  # tiny ones would overflow 1/T
    "top_p": st.floats(0, 1, exclude_min=True) | st.sampled_from([5e-324, 1e-39, 1.0]),
    "top_k": st.integers(-1, 300) | st.sampled_from([2**31 - 1]),
    "seed": st.integers(-(2**63), 2**64 - 1),
    "stop": st.text(min_size=1, max_size=4) | st.lists(st.text(min_size=1, max_size=4), min_size=1, max_size=4),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
    "n": st.just(1),
    "return_token_ids": st.booleans(),
    "cache_salt": st.text(max_size=8),
    "user": good_text,  # an OpenAI field the server ignores
}
BAD = {
    "max_tokens": st.integers(max_value=0) | big_ints | bad_floats,
    "temperature": bad_floats,
    "top_p": bad_floats | st.sampled_from([0, -0.0]),
    "top_k": st.integers(max_value=-2) | big_ints,
    "seed": big_ints | bad_floats,
    "stop": st.lists(good_text, min_size=5) | st.just([""]) | any_text,
    "stream_options": junk,
    "n": st.integers(min_value=2) | st.integers(max_value=0),
    "cache_salt": st.text(min_size=257, max_size=300),
    "user": any_text,
}
TOOL_CALL = st.fixed_dictionaries(
    {
        "id": good_text,
        "type": st.just("function"),
        "function": st.fixed_dictionaries(
            {"name": good_text, "arguments": good_text | st.just('{"a": 1}') | st.just("[" * 5000 + "]" * 5000)}
        ),
    }
)
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "developer", "user", "assistant", "tool"])},
    optional={
        "content": good_text
        | st.none()
        | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": good_text}), max_size=2),
        "name": good_text,
        "tool_calls": st.lists(TOOL_CALL, max_size=2),
        "tool_call_id": good_text,
        "reasoning_content": good_text,
    },
)
TOOL = st.fixed_dictionaries(
    {
        "type": st.just("function"),
        "function": st.fixed_dictionaries(
            {"name": st.from_regex(r"[a-z_]{1,12}", fullmatch=True)},
            optional={"description": good_text, "parameters": st.dictionaries(good_text, scalars, max_size=3)},
        ),
    }
)
TOOL_FIELDS = {  # chat only
    "tools": st.lists(TOOL, max_size=2),
    "tool_choice": st.sampled_from(["none", "auto", "required"]),
    "parallel_tool_calls": st.booleans(),
    "chat_template_kwargs": st.dictionaries(good_text, scalars, max_size=2),
}
BAD_TOOL_FIELDS = {
    "tools": junk | st.lists(TOOL.map(lambda t: {**t, "type": "code"}), min_size=1, max_size=1),
    "tool_choice": junk
    | any_text
    | st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries({"name": good_text})}),
    "chat_template_kwargs": junk | st.just({"chat_template": "{{ 1/0 }}"}) | st.just({"tools": []}),
}
ENDPOINTS = {
    "/v1/chat/completions": (
        {"model": st.just(MODEL), "messages": st.lists(MESSAGE, min_size=1, max_size=3)},
        {
            "messages": st.just([])
            | st.lists(MESSAGE.map(lambda m: {**m, "role": "wizard"}), min_size=1, max_size=2)
            | st.lists(
                MESSAGE.map(lambda m: {**m, "content": [{"type": "image_url", "text": "x"}]}), min_size=1, max_size=1
            ),
            **BAD_TOOL_FIELDS,
        },
        {"max_completion_tokens": st.integers(1, 8), **TOOL_FIELDS},
    ),
    "/v1/completions": (
        {
            "model": st.just(MODEL),
            "prompt": st.text(min_size=1, max_size=40) | st.lists(st.integers(0, 255), min_size=1, max_size=12),
        },
        {"prompt": st.just("") | st.just([]) | st.lists(st.integers(-5, 10**9) | big_ints, min_size=1, max_size=4)},
        {},
    ),
}


@st.composite
def bodies(draw, path):
    """A body as the wire sees it: a valid one, one with a field out of its domain, wrong in type or holding
    a lone surrogate, one missing a required field, any JSON at all, or bytes that are not JSON or UTF-8."""
    required, bad_required, extra_good = ENDPOINTS[path]
    body = draw(st.fixed_dictionaries(required, optional={**GOOD, **extra_good}))
    mode = draw(
        st.sampled_from(
            ["valid", "valid", "bad_field", "bad_field", "junk_field", "missing", "model", "any_json", "bytes"]
        )
    )
    if mode == "bad_field":
        key = draw(st.sampled_from(sorted({*BAD, *bad_required})))
        body[key] = draw({**BAD, **bad_required}[key])
    elif mode == "junk_field":
        body[draw(st.sampled_from([*required, *GOOD]) | any_text)] = draw(junk)
    elif mode == "missing":
        body.pop(draw(st.sampled_from(sorted(required))))
    elif mode == "model":
        body["model"] = draw(st.sampled_from(["gpt-4o", ""]) | any_text)
    elif mode == "any_json":
        body = draw(junk)
    elif mode == "bytes":
        return draw(st.binary(max_size=40))
    return json.dumps(body).encode()  # ensure_ascii: a lone surrogate goes out as \udXXX; NaN as NaN


@pytest.fixture(scope="module")
def fuzz_server(make_service):
    svc = make_service("qwen3_5", max_tokens_cap=8, request_timeout=20)
    with BackgroundServer(svc) as srv:
        yield srv
    print(f"\nfuzz: sent {SENT['bodies']} bodies ({SENT['2xx']} served, {SENT['4xx']} refused), 0 5xx")


def check(client, path, data: bytes) -> None:
    r = client.post(path, content=data, headers={"content-type": "application/json"})
    SENT["bodies"] += 1
    assert r.status_code < 500, (data, r.status_code, r.text)
    if r.status_code != 200:
        SENT["4xx"] += 1
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}, r.text
        assert isinstance(err["message"], str) and err["message"] and "Traceback" not in err["message"]
        return
    SENT["2xx"] += 1
    if r.headers["content-type"].startswith("text/event-stream"):
        events = [line[5:].strip() for line in r.text.splitlines() if line.startswith("data:")]
        assert events[-1] == "[DONE]", r.text
        assert not any('"error"' in e for e in events), r.text
    else:
        assert r.json()["choices"], r.text


FUZZ = settings(
    max_examples=FUZZ_EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"], ids=["chat", "completions"])
def test_no_body_gets_a_5xx(fuzz_server, path):
    ref_body = {
        "model": MODEL,
        "prompt": "Once upon a time",
        "max_tokens": 6,
        "temperature": 0,
        "return_token_ids": True,
    }
    with httpx.Client(base_url=fuzz_server.base_url, timeout=60) as client:
        reference = client.post("/v1/completions", json=ref_body).json()["choices"][0]["token_ids"]

        @FUZZ
        @given(bodies(path))
        def fuzz(data):
            check(client, path, data)

        fuzz()
        # the server is unharmed: nothing left running, and a request gives the same tokens as before
        wait_idle(fuzz_server.service)
        assert client.post("/v1/completions", json=ref_body).json()["choices"][0]["token_ids"] == reference
    assert SENT["bodies"] >= FUZZ_EXAMPLES

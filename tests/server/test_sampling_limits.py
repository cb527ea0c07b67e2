"""Sampling fields at and past their limits: a value whose arithmetic would leave the finite floats is a 400 in the
route's own format; at the limit the reply is valid JSON (no NaN, no Infinity, streamed or not); a grammar whose only
next token `min_tokens` bans ends the reply with "stop", as the README promises."""

import json

import httpx
import pytest

MODEL = "tiny-qwen3_5"
MESSAGES = [{"role": "user", "content": "The quick brown fox"}]
SMALL_OBJECT = {
    "type": "json_schema",
    "json_schema": {
        "name": "flag",
        "schema": {
            "type": "object",
            "properties": {"ok": {"type": "boolean"}},
            "required": ["ok"],
            "additionalProperties": False,
        },
    },
}


def _strict(text: str):
    """JSON as the spec has it: NaN and Infinity are not numbers."""

    def refuse(constant):
        raise AssertionError(f"{constant} in {text[:300]}")

    return json.loads(text, parse_constant=refuse)


def _post(srv, path: str, body: dict, stream: bool = False) -> tuple[int, list]:
    """(status, the JSON body, or each streamed data line's), every one parsed strictly."""
    resp = httpx.post(srv.base_url + path, json={"model": MODEL, **body, "stream": stream}, timeout=120)
    assert resp.status_code < 500, resp.text
    if not stream or resp.status_code != 200:
        return resp.status_code, [_strict(resp.text)]
    lines = [ln[len("data:") :].strip() for ln in resp.text.splitlines() if ln.startswith("data:")]
    return resp.status_code, [_strict(ln) for ln in lines if ln != "[DONE]"]


@pytest.mark.parametrize(
    "field, value",
    [
        ("repetition_penalty", 1e-39),
        ("repetition_penalty", 1e-38),
        ("repetition_penalty", 1e-20),
        ("repetition_penalty", 0.009),
        ("logit_bias", {"²": 1}),
        ("logit_bias", {"--5": 1}),
        ("logit_bias", {"٣": 1}),
        ("logit_bias", {"5": 1, "05": 2}),
    ],
)
def test_values_past_the_limits_are_400s_in_each_routes_format(qwen35_server, field, value):
    base = {field: value, "max_tokens": 4, "temperature": 1.0}
    status, (chat,) = _post(qwen35_server, "/v1/chat/completions", {**base, "messages": MESSAGES, "logprobs": True})
    assert status == 400 and chat["error"]["param"] == field, chat
    status, (msg,) = _post(qwen35_server, "/v1/messages", {**base, "messages": MESSAGES})
    assert status == 400 and msg["type"] == "error" and msg["error"]["type"] == "invalid_request_error", msg
    assert field in msg["error"]["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_at_the_limits_replies_are_finite_json(qwen35_server, stream):
    """The lowest repetition penalty, sampled, with logprobs; logit_bias keys with spaces and a sign, as int reads."""
    body = {
        "messages": MESSAGES,
        "max_tokens": 6,
        "temperature": 2.0,
        "top_p": 5e-324,
        "seed": 1,
        "repetition_penalty": 0.01,
        "logprobs": True,
        "top_logprobs": 20,
        "logit_bias": {" 5 ": 100, "-0": -100},
        "presence_penalty": -2,
        "frequency_penalty": -2,
    }
    status, parts = _post(qwen35_server, "/v1/chat/completions", body, stream)
    assert status == 200 and parts
    status, parts = _post(
        qwen35_server,
        "/v1/completions",
        {
            **{k: v for k, v in body.items() if k not in ("messages", "logprobs", "top_logprobs")},
            "prompt": "The quick",
            "logprobs": 5,
        },
        stream,
    )
    assert status == 200 and parts


@pytest.mark.parametrize("stream", [False, True])
def test_a_grammar_min_tokens_leaves_no_token_for_ends_with_stop(qwen35_server, stream):
    """The object is complete after a few tokens; then the grammar allows only the end of sequence, which
    `min_tokens` bans: no token is left, so the reply ends there. Its logprobs hold banned tokens (-inf)."""
    body = {
        "messages": MESSAGES,
        "max_tokens": 40,
        "min_tokens": 40,
        "temperature": 0,
        "seed": 0,
        "response_format": SMALL_OBJECT,
        "logprobs": True,
        "top_logprobs": 5,
    }
    status, parts = _post(qwen35_server, "/v1/chat/completions", body, stream)
    assert status == 200, parts
    if stream:
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in parts if c.get("choices"))
        reasons = [c["choices"][0]["finish_reason"] for c in parts if c.get("choices")]
        floors = [
            t["logprob"]
            for c in parts
            if c.get("choices") and c["choices"][0].get("logprobs")
            for e in c["choices"][0]["logprobs"]["content"]
            for t in e["top_logprobs"]
        ]
    else:
        choice = parts[0]["choices"][0]
        text, reasons = choice["message"]["content"], [choice["finish_reason"]]
        floors = [t["logprob"] for e in choice["logprobs"]["content"] for t in e["top_logprobs"]]
    assert reasons[-1] == "stop" and isinstance(json.loads(text)["ok"], bool)
    assert -9999.0 in floors  # a banned token's logprob, as vLLM reports it


def test_a_logprob_json_cannot_carry_is_reported_as_the_floor():
    """-inf (a banned token) and NaN (which `max(nan, floor)` passed on) both go out as vLLM's -9999."""
    from hyserve.server.formats import _finite

    assert [_finite(v) for v in (float("-inf"), float("nan"), -1e30, -2.5, 0.0)] == [
        -9999.0,
        -9999.0,
        -9999.0,
        -2.5,
        0.0,
    ]

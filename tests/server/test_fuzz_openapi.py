"""Fuzzing every POST route from the server's own `/openapi.json` (schemathesis: bodies that fit each route's
schema and bodies that break it): no 5xx, every body valid JSON, every stream line `data: <JSON>` or
`data: [DONE]`. The hand-written fuzzers (test_fuzz*.py) go deeper on the completion routes; this one follows
the document, so a route added later is fuzzed too. Bounded: FUZZ_EXAMPLES cases per route (env
HYSERVE_FUZZ_OPENAPI_EXAMPLES) of each kind, each at most 8 tokens."""

import json
import os
from collections import Counter

import httpx
import pytest

schemathesis = pytest.importorskip("schemathesis")

from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402

from hyserve.server.run import BackgroundServer  # noqa: E402

MODEL = "tiny-qwen3_5"
FUZZ_EXAMPLES = int(os.environ.get("HYSERVE_FUZZ_OPENAPI_EXAMPLES", "10"))
# no shrinking: a failure is reported as sent (shrinking a served request took minutes)
FUZZ = settings(
    max_examples=FUZZ_EXAMPLES,
    deadline=None,
    database=None,
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=list(HealthCheck),
)
SENT: Counter = Counter()  # (path, status class) -> cases


@pytest.fixture(scope="module")
def openapi_server(make_service):
    svc = make_service("qwen3_5", max_tokens_cap=8, request_timeout=20)
    with BackgroundServer(svc) as srv:
        yield srv


def check_body(response, case) -> None:
    """No 5xx; a JSON body parses; an event stream's `data:` lines are JSON or [DONE]."""
    sent = (case.method, case.path, case.body)
    assert response.status_code < 500, (sent, response.status_code, response.text)
    kind = " ".join(response.headers.get("content-type", []))  # a header's values, as a list
    if "text/event-stream" in kind:
        for line in response.text.splitlines():
            if line.startswith("data:") and line[5:].strip() != "[DONE]":
                _json(line[5:], sent)
    elif response.content:
        assert "application/json" in kind, (sent, kind, response.text)
        _json(response.text, sent)


def _json(text: str, sent) -> None:
    def refuse(name):
        raise ValueError(f"{name} is not JSON")

    try:
        json.loads(text, parse_constant=refuse)
    except ValueError as exc:
        raise AssertionError((sent, text)) from exc


def served_model_only(node) -> None:
    """Every `model` field of the document names the one model served: a random name is only ever a 404, and
    the fitting bodies would never reach generation."""
    if isinstance(node, dict):
        if isinstance(node.get("properties"), dict) and "model" in node["properties"]:
            node["properties"]["model"] = {"type": "string", "enum": [MODEL]}
        for value in node.values():
            served_model_only(value)
    elif isinstance(node, list):
        for value in node:
            served_model_only(value)


def post_operations(base_url: str) -> list:
    """The POST operations of the server's document, with bodies of both kinds: fitting and breaking it."""
    doc = httpx.get(f"{base_url}/openapi.json", timeout=30).json()
    served_model_only(doc)
    schema = schemathesis.openapi.from_dict(doc)
    schema.config.update(base_url=base_url)
    return [op.ok() for op in schema.include(method="POST").get_all_operations()]


def test_no_post_gets_a_5xx_or_invalid_json(openapi_server):
    operations = post_operations(openapi_server.base_url)
    paths = {op.path for op in operations}
    assert {"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages", "/tokenize"} <= paths
    for op in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

            @FUZZ
            @given(case=op.as_strategy(generation_mode=mode))
            def fuzz(case):
                response = case.call(timeout=60)
                SENT[op.path, response.status_code // 100] += 1  # noqa: B023 (fuzz is called at once, below)
                check_body(response, case)

            fuzz()
    print("\nfuzz: " + ", ".join(f"{path} {n}x{kind}xx" for (path, kind), n in sorted(SENT.items())))
    assert {path for path, _ in SENT} == paths


# Bodies this fuzzer found answered with a 500, kept as regressions.
FOUND = [
    # a tiny repetition penalty scaled the prompt's logits to inf, and sampling them made NaN
    {"messages": [{"role": "user", "content": "hi"}], "repetition_penalty": 5e-324, "seed": 1},
    # the grammar allows only the end ("") while min_tokens bans it: nothing left to sample, greedy or not
    {"messages": [{"role": "user", "content": "hi"}], "guided_choice": [""], "min_tokens": 3},
    {"messages": [{"role": "user", "content": "hi"}], "guided_choice": [""], "min_tokens": 1, "temperature": 0},
]


@pytest.mark.parametrize("body", FOUND)
def test_bodies_found_by_the_fuzzer(openapi_server, body):
    r = httpx.post(f"{openapi_server.base_url}/v1/chat/completions", json={"model": MODEL, **body}, timeout=60)
    if "repetition_penalty" in body:  # now refused up front: out of the range where its arithmetic stays finite
        assert r.status_code == 400 and r.json()["error"]["param"] == "repetition_penalty", r.text
        return
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")

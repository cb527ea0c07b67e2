"""Structured outputs through the official `openai` client: `response_format`, vLLM's `structured_outputs`
and `guided_*`. Random weights + a constraint -> output the constraint accepts (greedy and sampled)."""

import json
import re

import openai
import pytest

from hyserve.server.run import BackgroundServer

from ..conftest import wait_idle
from ..test_structured import SCHEMA, matches_schema
from .test_openai_api import client

MSGS = [{"role": "user", "content": "Give me a person as JSON."}]
MODEL = "tiny-qwen3_5"
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}


def chat(c, **kw):
    kw.setdefault("temperature", 0)
    kw.setdefault("max_tokens", 60)
    return c.chat.completions.create(model=MODEL, messages=MSGS, **kw)


def test_json_schema_chat_greedy_is_valid_and_equal_streamed_and_with_the_cache_off(qwen35_server, make_service):
    c = client(qwen35_server)
    first = chat(c, response_format=JSON_SCHEMA)
    text = first.choices[0].message.content
    assert first.choices[0].finish_reason == "stop" and matches_schema(json.loads(text))
    wait_idle(qwen35_server.service)  # the prompt's checkpoint is recorded in idle time, as a reader gives it
    again = chat(c, response_format=JSON_SCHEMA)
    assert again.choices[0].message.content == text and again.usage.prompt_tokens_details.cached_tokens > 0
    streamed = "".join(
        ch.choices[0].delta.content or "" for ch in chat(c, response_format=JSON_SCHEMA, stream=True) if ch.choices
    )
    assert streamed == text
    with BackgroundServer(make_service("qwen3_5", cache_enabled=False)) as off:
        assert chat(client(off), response_format=JSON_SCHEMA).choices[0].message.content == text


def test_sampled_replies_match_the_schema(qwen35_server):
    c = client(qwen35_server)
    for seed in (1, 2, 3):
        r = chat(c, response_format=JSON_SCHEMA, temperature=1.0, seed=seed)
        assert r.choices[0].finish_reason == "stop" and matches_schema(json.loads(r.choices[0].message.content))


def test_json_object_opens_an_object_where_plain_decoding_does_not(qwen35_server):
    c = client(qwen35_server)
    plain = chat(c, max_tokens=8).choices[0].message.content
    for r in (
        chat(c, response_format={"type": "json_object"}, max_tokens=8),
        chat(c, max_tokens=8, extra_body={"structured_outputs": {"json_object": True}}),
    ):
        assert r.choices[0].message.content.startswith('{"')
    assert not plain.startswith("{")
    done = c.completions.create(
        model=MODEL,
        prompt="JSON:",
        temperature=0,
        max_tokens=40,
        extra_body={
            "guided_json": {
                "type": "object",
                "properties": {"a": {"type": "boolean"}},
                "required": ["a"],
                "additionalProperties": False,
            }
        },
    )
    assert done.choices[0].finish_reason == "stop" and isinstance(json.loads(done.choices[0].text)["a"], bool)


@pytest.mark.parametrize(
    "extra, check",
    [
        ({"guided_choice": ["yes", "no way", 'say "hi"']}, lambda t: t in ("yes", "no way", 'say "hi"')),
        ({"structured_outputs": {"choice": ["alpha", "beta"]}}, lambda t: t in ("alpha", "beta")),
        ({"guided_regex": r"[a-z]{3}-[0-9]{2}"}, lambda t: re.fullmatch(r"[a-z]{3}-[0-9]{2}", t)),
        (
            {"structured_outputs": {"regex": r"(red|blue) [0-9]{1,3}\."}},
            lambda t: re.fullmatch(r"(red|blue) [0-9]{1,3}\.", t),
        ),
        ({"guided_grammar": 'start: "a" ("b" | "c")~3'}, lambda t: re.fullmatch(r"a[bc]{3}", t)),
        ({"structured_outputs": {"grammar": 'root ::= "x" [0-9] [0-9]'}}, lambda t: re.fullmatch(r"x[0-9]{2}", t)),
    ],
)
def test_choice_regex_and_grammar_on_chat_and_completions(qwen35_server, extra, check):
    c = client(qwen35_server)
    r = chat(c, max_tokens=30, extra_body=extra)
    assert r.choices[0].finish_reason == "stop" and check(r.choices[0].message.content)
    r = c.completions.create(model=MODEL, prompt="Answer:", max_tokens=30, temperature=1.0, seed=7, extra_body=extra)
    assert r.choices[0].finish_reason == "stop" and check(r.choices[0].text)


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"guided_regex": "[a-"}, "guided_regex"),
        ({"guided_json": {"type": "nosuch"}}, "guided_json"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"structured_outputs": {"grammar": "start: undefined_rule"}}, "structured_outputs.grammar"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nosuch"}}}},
            "response_format.json_schema.schema",
        ),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ],
)
def test_bad_constraints_are_400s_naming_the_field(qwen35_server, extra, param):
    c = client(qwen35_server)
    with pytest.raises(openai.BadRequestError) as exc:
        chat(c, extra_body=extra)
    assert exc.value.status_code == 400 and exc.value.body["param"] == param
    assert chat(c, max_tokens=2).choices[0].message.content is not None  # the server goes on


def test_real_qwen35_template_constrains_the_answer_not_the_reasoning(template_servers):
    from ..conftest import QWEN35_TEMPLATE

    srv = template_servers("qwen3_5", QWEN35_TEMPLATE)
    r = client(srv).chat.completions.create(
        model="tpl",
        messages=MSGS,
        temperature=0,
        max_tokens=60,
        response_format=JSON_SCHEMA,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    assert r.choices[0].finish_reason == "stop" and matches_schema(json.loads(r.choices[0].message.content))
    # thinking on: the prompt opens `<think>`, so the reasoning is free (this random model never closes it)
    r = client(srv).chat.completions.create(
        model="tpl", messages=MSGS, temperature=0, max_tokens=6, extra_body={"guided_choice": ["yes", "no"]}
    )
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.content in (None, "")


def test_constrained_and_plain_requests_batched_together_equal_each_alone(qwen35_server):
    from concurrent.futures import ThreadPoolExecutor

    c = client(qwen35_server)
    kinds = [{"response_format": JSON_SCHEMA}, {"extra_body": {"guided_regex": "[a-z]{30}"}}, {}, {}]
    alone = [chat(c, max_tokens=40, **kw).choices[0].message.content for kw in kinds]
    with ThreadPoolExecutor(len(kinds)) as pool:
        together = list(pool.map(lambda kw: chat(c, max_tokens=40, **kw).choices[0].message.content, kinds * 2))
    assert together == alone * 2
    reg = qwen35_server.service.metrics.registry
    rows, passes = (reg.get_sample_value(f"hyserve_decode_batch_size_{s}") for s in ("sum", "count"))
    assert rows > passes  # some passes held several requests

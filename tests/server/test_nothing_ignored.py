"""Nothing a client sends is silently ignored (issue #35, item 5): chat's `reasoning_effort`, the legacy
`functions` / `function_call`, Responses' `text.format` and new `tools` on a continuation are honoured; an
unknown field is named in a log line and the `X-Hyserve-Ignored-Fields` header; a non-text content part and
Anthropic's `stop_sequences` get errors that name them. Real servers on tiny models with the real Qwen3.5
template; replies forced (`force`) where the test needs a known one."""

import json

import httpx
from openai import OpenAI

from hyserve.chat import template_message

from ..conftest import QWEN35_TEMPLATE
from ..parsers.helpers import TOOLS

QWEN35 = ("qwen3_5", QWEN35_TEMPLATE)
ASK = [{"role": "user", "content": "Weather in Paris?"}]
XML_CALL = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n"
    "</parameter>\n</function>\n</tool_call>"
)
FUNCTIONS = [t["function"] for t in TOOLS]


def client(srv) -> OpenAI:
    return OpenAI(base_url=f"{srv.base_url}/v1", api_key="unused", max_retries=0)


def post(srv, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{srv.base_url}{path}", json={"model": "tpl", **body}, timeout=60)


def test_chat_reasoning_effort_none_turns_thinking_off(template_servers, force):
    srv = template_servers(*QWEN35)
    rt = srv.service.runtime
    off = rt.render_chat(ASK, True, template_kwargs={"enable_thinking": False})
    resp = client(srv).chat.completions.create(
        model="tpl", messages=ASK, reasoning_effort="none", seed=force(rt, "Paris is sunny.")
    )
    assert resp.usage.prompt_tokens == len(off)  # the prompt closes the thinking block
    assert resp.choices[0].message.content == "Paris is sunny."
    assert (resp.choices[0].message.model_extra or {}).get("reasoning_content") is None


def test_legacy_functions_are_tools_and_the_call_comes_back_as_function_call(template_servers, force):
    srv = template_servers(*QWEN35)
    rt = srv.service.runtime
    text = "ok\n</think>\n\n" + XML_CALL
    for function_call in (None, "auto", {"name": "get_weather"}):
        extra = {} if function_call is None else {"function_call": function_call}
        resp = client(srv).chat.completions.create(
            model="tpl", messages=ASK, functions=FUNCTIONS, seed=force(rt, text), **extra
        )
        choice = resp.choices[0]
        assert choice.finish_reason == "function_call" and not choice.message.tool_calls
        assert choice.message.function_call.name == "get_weather"
        assert json.loads(choice.message.function_call.arguments) == {"city": "Paris", "days": 3}
        assert "<tool_call>" not in (choice.message.content or "")
    assert resp.usage.prompt_tokens == len(rt.render_chat(ASK, True, template_kwargs={"tools": TOOLS}))

    chunks = list(
        client(srv).chat.completions.create(
            model="tpl", messages=ASK, functions=FUNCTIONS, seed=force(rt, text), stream=True
        )
    )
    deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
    assert all(not d.tool_calls for d in deltas)
    calls = [d.function_call for d in deltas if d.function_call]
    assert calls[0].name == "get_weather"
    assert json.loads("".join(c.arguments or "" for c in calls)) == {"city": "Paris", "days": 3}
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "function_call"

    # the next turn in the legacy form: the assistant's function_call and a `function` message with the result
    history = [
        *ASK,
        {"role": "assistant", "content": None, "function_call": choice.message.function_call.to_dict()},
        {"role": "function", "name": "get_weather", "content": "sunny, 21 C"},
    ]
    r2 = post(srv, "/v1/chat/completions", {"messages": history, "functions": FUNCTIONS, "max_tokens": 2})
    assert r2.status_code == 200, r2.text
    prompt = rt.render_chat([template_message(m) for m in history], True, template_kwargs={"tools": TOOLS})
    assert r2.json()["usage"]["prompt_tokens"] == len(prompt) and "sunny, 21 C" in rt.tokenizer.decode(prompt)


def test_legacy_function_call_errors_name_function_call(template_servers):
    srv = template_servers(*QWEN35)
    r = post(srv, "/v1/chat/completions", {"messages": ASK, "functions": FUNCTIONS, "function_call": {"name": "nope"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "function_call", r.text
    r = post(srv, "/v1/chat/completions", {"messages": ASK, "functions": FUNCTIONS, "tools": TOOLS})
    assert r.status_code == 400 and "not both" in r.json()["error"]["message"], r.text


def test_an_image_part_is_refused_as_text_only(template_servers):
    srv = template_servers(*QWEN35)
    content = [
        {"type": "text", "text": "What is this?"},
        {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}},
    ]
    r = post(srv, "/v1/chat/completions", {"messages": [{"role": "user", "content": content}]})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "messages[0].content[1]" and "text-only" in err["message"] and "image_url" in err["message"]


def test_images_on_responses_and_messages_are_refused_as_text_only(template_servers):
    srv = template_servers(*QWEN35)
    image = {"type": "input_image", "image_url": "https://example.com/cat.png"}
    r = post(srv, "/v1/responses", {"input": [{"role": "user", "content": [image]}]})
    assert r.status_code == 400 and "text-only" in r.json()["error"]["message"], r.text
    assert r.json()["error"]["param"] == "input[0].content[0]"
    image = {"type": "image", "source": {"type": "url", "url": "https://example.com/cat.png"}}
    r = post(srv, "/v1/messages", {"max_tokens": 4, "messages": [{"role": "user", "content": [image]}]})
    assert r.status_code == 400 and "text-only" in r.json()["error"]["message"], r.text


def test_anthropic_stop_sequences_errors_name_stop_sequences(template_servers):
    srv = template_servers(*QWEN35)
    r = post(srv, "/v1/messages", {"messages": ASK, "max_tokens": 4, "stop_sequences": list("abcde")})
    assert r.status_code == 400 and r.json()["type"] == "error", r.text
    assert "stop_sequences" in r.json()["error"]["message"] and "stop:" not in r.json()["error"]["message"]


def test_the_token_cap_error_names_the_field_sent(template_servers):
    srv = template_servers(*QWEN35, max_tokens_cap=8)
    for path, body, field in [
        ("/v1/responses", {"input": "Hi", "max_output_tokens": 9}, "max_output_tokens"),
        ("/v1/chat/completions", {"messages": ASK, "max_completion_tokens": 9}, "max_completion_tokens"),
        ("/v1/chat/completions", {"messages": ASK, "max_tokens": 9}, "max_tokens"),
    ]:
        r = post(srv, path, body)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
        assert r.json()["error"]["message"].startswith(field + " ")


def test_responses_text_format_and_messages_response_format_constrain_the_output(qwen35_server):
    from ..test_structured import SCHEMA, matches_schema

    c = OpenAI(base_url=f"{qwen35_server.base_url}/v1", api_key="unused", max_retries=0)
    fmt = {"type": "json_schema", "name": "person", "schema": SCHEMA, "strict": True}
    r = c.responses.create(
        model="tiny-qwen3_5",
        input="Give me a person as JSON.",
        temperature=0,
        max_output_tokens=60,
        text={"format": fmt},
        store=False,
    )
    assert r.status == "completed" and matches_schema(json.loads(r.output_text))
    assert r.text.format.type == "json_schema" and r.text.format.name == "person"
    r = c.responses.create(
        model="tiny-qwen3_5",
        input="JSON please.",
        temperature=0,
        max_output_tokens=8,
        text={"format": {"type": "json_object"}},
        store=False,
    )
    assert r.output_text.startswith('{"')
    m = httpx.post(
        f"{qwen35_server.base_url}/v1/messages",
        timeout=60,
        json={
            "model": "tiny-qwen3_5",
            "messages": [{"role": "user", "content": "JSON please."}],
            "max_tokens": 8,
            "temperature": 0,
            "response_format": {"type": "json_object"},
        },
    )
    assert m.status_code == 200 and m.json()["content"][-1]["text"].startswith('{"'), m.text
    bad = httpx.post(
        f"{qwen35_server.base_url}/v1/responses",
        timeout=60,
        json={"model": "tiny-qwen3_5", "input": "x", "text": {"format": {"type": "json_schema", "name": "p"}}},
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "text.format", bad.text


def test_unknown_fields_are_named_in_a_header_and_a_log_line(template_servers, caplog):
    srv = template_servers(*QWEN35)
    bodies = {
        "/v1/chat/completions": {"messages": ASK, "max_tokens": 1, "temprature": 0.5, "max_token": 9},
        "/v1/completions": {"prompt": "Hi", "max_tokens": 1, "temprature": 0.5, "max_token": 9},
        "/v1/responses": {"input": "Hi", "max_output_tokens": 1, "store": False, "temprature": 0.5, "max_token": 9},
        "/v1/messages": {"messages": ASK, "max_tokens": 1, "temprature": 0.5, "max_token": 9},
        "/v1/messages/count_tokens": {"messages": ASK, "temprature": 0.5, "max_token": 9},
    }
    with caplog.at_level("WARNING", logger="hyserve.http"):
        for path, body in bodies.items():
            for stream in (False, True) if path != "/v1/messages/count_tokens" else (False,):
                r = post(srv, path, {**body, **({"stream": True} if stream else {})})
                assert r.status_code == 200, (path, r.text)
                assert r.headers["X-Hyserve-Ignored-Fields"] == "max_token, temprature", path
    lines = [rec.getMessage() for rec in caplog.records if "ignored" in rec.getMessage()]
    assert len(lines) == 9 and all("max_token, temprature" in line for line in lines), lines
    known = post(srv, "/v1/chat/completions", {"messages": ASK, "max_tokens": 1, "temperature": 0.5})
    assert known.status_code == 200 and "X-Hyserve-Ignored-Fields" not in known.headers
    odd = post(srv, "/v1/chat/completions", {"messages": ASK, "max_tokens": 1, "bad\nkey\u00e9": 1})
    assert odd.headers["X-Hyserve-Ignored-Fields"] == "bad\\nkey\\u00e9"


def test_new_tools_on_a_continuation_are_in_its_prompt(template_servers, force):
    srv = template_servers(*QWEN35)
    rt = srv.service.runtime
    flat = [{"type": "function", **t["function"]} for t in TOOLS]
    c = client(srv)
    r1 = c.responses.create(model="tpl", input="Hello", extra_body={"seed": force(rt, "Greeting.\n</think>\n\nHi.")})
    r2 = c.responses.create(
        model="tpl",
        input="Weather in Paris?",
        previous_response_id=r1.id,
        tools=flat,
        extra_body={"seed": force(rt, "ok\n</think>\n\n" + XML_CALL)},
    )
    conversation = [
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hi.", "reasoning_content": "Greeting."},
        {"role": "user", "content": "Weather in Paris?"},
    ]
    prompt = rt.render_chat(conversation, True, template_kwargs={"tools": TOOLS})
    assert r2.usage.input_tokens == len(prompt)  # the tools are listed, as in the same conversation sent whole
    assert [i.type for i in r2.output][-1] == "function_call" and r2.output[-1].name == "get_weather"
    # the tools unchanged: the next turn continues the stored tokens, all read from the cache
    r3 = c.responses.create(
        model="tpl",
        previous_response_id=r2.id,
        tools=flat,
        max_output_tokens=2,
        input=[{"type": "function_call_output", "call_id": r2.output[-1].call_id, "output": "sunny"}],
    )
    assert r3.usage.input_tokens_details.cached_tokens == r2.usage.input_tokens + r2.usage.output_tokens

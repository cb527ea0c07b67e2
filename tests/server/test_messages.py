"""`/v1/messages` through the real `anthropic` client against real servers on tiny models with the real Qwen3.5
template: text, streaming (the client's own accumulation), forced thinking + tool_use and a tool_result turn
read from the prefix cache (`cache_read_input_tokens`), cache on == cache off, API keys sent as `x-api-key`,
and errors in Anthropic's shape."""

import httpx
import pytest

anthropic = pytest.importorskip("anthropic")

from ..conftest import QWEN35_TEMPLATE  # noqa: E402
from ..parsers.helpers import TOOLS  # noqa: E402

QWEN35 = ("qwen3_5", QWEN35_TEMPLATE)
XML_CALL = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n"
    "</parameter>\n</function>\n</tool_call>"
)
REPLY = "The user wants weather.\n</think>\n\nChecking.\n\n" + XML_CALL
ANTHROPIC_TOOLS = [
    {
        "name": t["function"]["name"],
        "description": t["function"].get("description", ""),
        "input_schema": t["function"]["parameters"],
    }
    for t in TOOLS
]
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def client(srv, key: str = "unused"):
    return anthropic.Anthropic(base_url=srv.base_url, api_key=key, max_retries=0)


def greedy(seed=None) -> dict:
    """`temperature` (this client version has no such argument) and a forcing seed, as extra body fields."""
    return {"extra_body": {"temperature": 0, **({"seed": seed} if seed is not None else {})}}


def create(srv, key: str = "unused", seed=None, **kw):
    kw.setdefault("max_tokens", 8)
    return client(srv, key).messages.create(model="tpl", **kw, **greedy(seed))


def test_text_streaming_and_cache_parity(template_servers):
    on, off = template_servers(*QWEN35), template_servers(*QWEN35, cache_enabled=False)
    msgs = [{"role": "user", "content": [{"type": "text", "text": "Tell me a story"}]}]
    whole = create(on, system="Be terse.", messages=msgs)
    assert whole.type == "message" and whole.role == "assistant" and whole.stop_reason == "max_tokens"
    assert whole.usage.output_tokens == 8
    with client(on).messages.stream(model="tpl", system="Be terse.", messages=msgs, max_tokens=8, **greedy()) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in whole.content]
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 8
    # the second identical prompt reads its whole prompt but the last token from the cache
    assert final.usage.cache_read_input_tokens > 0
    assert (
        final.usage.input_tokens + final.usage.cache_read_input_tokens
        == whole.usage.input_tokens + whole.usage.cache_read_input_tokens
    )
    cold = create(off, system="Be terse.", messages=msgs)
    assert [b.model_dump() for b in cold.content] == [b.model_dump() for b in whole.content]
    assert cold.usage.cache_read_input_tokens == 0


def test_forced_thinking_tool_use_then_tool_result(template_servers, force):
    srv = template_servers(*QWEN35)
    rt = srv.service.runtime
    msg = create(srv, messages=ASK, tools=ANTHROPIC_TOOLS, max_tokens=128, seed=force(rt, REPLY))
    assert [b.type for b in msg.content] == ["thinking", "text", "tool_use"] and msg.stop_reason == "tool_use"
    assert msg.content[0].thinking == "The user wants weather." and msg.content[1].text == "Checking."
    use = msg.content[2]
    assert use.name == "get_weather" and use.input == {"city": "Paris", "days": 3} and use.id.startswith("toolu_")

    with client(srv).messages.stream(
        model="tpl", messages=ASK, tools=ANTHROPIC_TOOLS, max_tokens=128, **greedy(force(rt, REPLY))
    ) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text", "tool_use"]
    assert final.content[2].input == use.input and final.stop_reason == "tool_use"

    history = ASK + [
        {"role": "assistant", "content": [b.model_dump() for b in msg.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny, 21 C"}]},
    ]
    nxt = create(srv, messages=history, tools=ANTHROPIC_TOOLS, max_tokens=4)
    assert nxt.usage.cache_read_input_tokens >= msg.usage.input_tokens + msg.usage.cache_read_input_tokens
    tokens = client(srv).messages.count_tokens(model="tpl", messages=history, tools=ANTHROPIC_TOOLS)
    assert tokens.input_tokens == nxt.usage.input_tokens + nxt.usage.cache_read_input_tokens


def test_stop_sequence_is_reported(template_servers, force):
    srv = template_servers(*QWEN35)
    msg = create(
        srv,
        messages=ASK,
        max_tokens=128,
        stop_sequences=["STOP"],
        seed=force(srv.service.runtime, "Done.\n</think>\n\nYes STOP more"),
    )
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == "STOP" and msg.content[-1].text == "Yes"


def test_api_key_as_x_api_key(template_servers):
    srv = template_servers(*QWEN35, api_keys=("key-a",), max_body_bytes=4096)
    assert create(srv, "key-a", messages=ASK, max_tokens=2).usage.output_tokens == 2
    with pytest.raises(anthropic.AuthenticationError) as exc:
        create(srv, "wrong", messages=ASK, max_tokens=2)
    assert exc.value.body["type"] == "error" and exc.value.body["error"]["type"] == "authentication_error"
    big = httpx.post(
        f"{srv.base_url}/v1/messages",
        headers={"x-api-key": "key-a"},
        timeout=30,
        json={"model": "tpl", "max_tokens": 2, "messages": [{"role": "user", "content": "x" * 8192}]},
    )
    assert big.status_code == 413 and big.json()["error"]["type"] == "request_too_large"  # the guard's refusal


@pytest.mark.parametrize(
    "body,status",
    [
        ({"messages": ASK}, 400),  # max_tokens is required
        ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400),
        ({"max_tokens": 4, "messages": ASK, "tools": [{"type": "bash_20250124", "name": "bash"}]}, 400),
        ({"max_tokens": 4, "messages": ASK, "tool_choice": {"type": "tool", "name": "nope"}}, 400),
        ({"max_tokens": 4, "messages": [{"role": "robot", "content": "x"}]}, 400),
        ({"max_tokens": 4, "messages": ASK, "model": "other"}, 404),
    ],
)
def test_bad_input_is_an_error_in_anthropic_shape(template_servers, body, status):
    srv = template_servers(*QWEN35)
    r = httpx.post(f"{srv.base_url}/v1/messages", json={"model": "tpl", **body}, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] in ("invalid_request_error", "not_found_error")
    assert err["error"]["message"]
    bad_json = httpx.post(
        f"{srv.base_url}/v1/messages", content=b"{", timeout=30, headers={"content-type": "application/json"}
    )
    assert bad_json.status_code == 400 and bad_json.json()["type"] == "error"

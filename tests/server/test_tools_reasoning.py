"""Tool calls and reasoning through the `openai` client against real servers on tiny models with the real
Qwen3.5, Qwen3 and Llama 3.1 templates. The model's output is forced (`force`: the real engine decodes a
fixed token sequence), so the parsed reply is known; streamed replies are reassembled by the client's own
`ChatCompletionStreamState`. One test per parser also runs the model's own greedy output."""

import json

import httpx
import pytest
from openai import OpenAI
from openai.lib.streaming.chat import ChatCompletionStreamState

from hyserve.chat import template_message

from ..conftest import LLAMA3_TEMPLATE, QWEN3_TEMPLATE, QWEN35_TEMPLATE
from ..parsers.helpers import TOOLS

QWEN35 = ("qwen3_5", QWEN35_TEMPLATE)
QWEN3 = ("qwen3", QWEN3_TEMPLATE)
LLAMA3 = ("qwen3", LLAMA3_TEMPLATE)  # the template and its parser; the architecture does not matter here

ASK = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Weather in Paris?"}]
PARIS = {"city": "Paris", "days": 3}
XML_CALL = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n"
    "</parameter>\n</function>\n</tool_call>"
)
JSON_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'
REPLIES = {  # a reply with reasoning, an answer and a call, as each model writes it after its prompt
    QWEN35: ("The user wants weather.\n</think>\n\nChecking.\n\n" + XML_CALL, "The user wants weather.", "Checking."),
    QWEN3: (
        "<think>\nThe user wants weather.\n</think>\n\nChecking.\n" + JSON_CALL,
        "The user wants weather.",
        "Checking.",
    ),
    LLAMA3: ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}', None, None),
}


def client(srv) -> OpenAI:
    return OpenAI(base_url=f"{srv.base_url}/v1", api_key="unused", max_retries=0)


def extra(message_or_delta, key):
    return (message_or_delta.model_extra or {}).get(key)


def create(srv, messages, **kw):
    return client(srv).chat.completions.create(model="tpl", messages=messages, temperature=0, **kw)


def streamed(srv, messages, **kw):
    """(the completion the client reassembles from the stream, the reasoning streamed, the raw chunks)."""
    state, reasoning, chunks = ChatCompletionStreamState(), "", []
    for chunk in create(srv, messages, stream=True, **kw):
        chunks.append(chunk)
        state.handle_chunk(chunk)
        for ch in chunk.choices:
            reasoning += extra(ch.delta, "reasoning_content") or ""
    return state.current_completion_snapshot, reasoning, chunks


def calls_of(message):
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


@pytest.mark.parametrize("pair", [QWEN35, QWEN3, LLAMA3], ids=["qwen3.5-xml", "qwen3-hermes", "llama3-json"])
def test_forced_tool_call_with_reasoning(template_servers, force, pair):
    srv = template_servers(*pair)
    rt = srv.service.runtime
    text, reasoning, content = REPLIES[pair]
    resp = create(srv, ASK, tools=TOOLS, seed=force(rt, text))
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert calls_of(choice.message) == [("get_weather", PARIS)]
    assert choice.message.tool_calls[0].id.startswith("call_") and choice.message.tool_calls[0].type == "function"
    assert choice.message.content == content
    assert extra(choice.message, "reasoning_content") == reasoning and extra(choice.message, "reasoning") == reasoning

    final, streamed_reasoning, chunks = streamed(srv, ASK, tools=TOOLS, seed=force(rt, text))
    s = final.choices[0]
    assert s.finish_reason == "tool_calls" and (s.message.content or None) == content  # "" from the first chunk
    assert calls_of(s.message) == calls_of(choice.message)
    assert (streamed_reasoning or None) == reasoning
    pieces = [tc for c in chunks for ch in c.choices for tc in ch.delta.tool_calls or []]
    assert pieces[0].id and pieces[0].function.name == "get_weather"  # id and name first, then the arguments
    assert all(p.index == 0 for p in pieces) and all(p.id is None for p in pieces[1:])
    assert "".join(p.function.arguments or "" for p in pieces) == choice.message.tool_calls[0].function.arguments

    # The next turn: the client sends the message back as it got it, with the tool's result; it renders (the
    # arguments string parsed for the template) and extends the cached history.
    history = [
        *ASK,
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": choice.message.tool_calls[0].id, "content": "sunny, 21 C"},
    ]
    resp2 = create(srv, history, tools=TOOLS, max_tokens=3)
    prompt2 = rt.render_chat([template_message(m) for m in history], True, template_kwargs={"tools": TOOLS})
    assert resp2.usage.prompt_tokens == len(prompt2)
    assert "sunny, 21 C" in rt.tokenizer.decode(prompt2)
    assert resp2.usage.prompt_tokens_details.cached_tokens > 0


def test_parallel_calls_and_parallel_tool_calls_false(template_servers, force):
    srv = template_servers(*QWEN3)
    rt = srv.service.runtime
    text = JSON_CALL + "\n" + JSON_CALL.replace("Paris", "Rome")
    both = [("get_weather", PARIS), ("get_weather", {"city": "Rome", "days": 3})]
    assert calls_of(create(srv, ASK, tools=TOOLS, seed=force(rt, text)).choices[0].message) == both
    final, _, chunks = streamed(srv, ASK, tools=TOOLS, seed=force(rt, text))
    assert calls_of(final.choices[0].message) == both
    assert {tc.index for c in chunks for ch in c.choices for tc in ch.delta.tool_calls or []} == {0, 1}
    one = create(srv, ASK, tools=TOOLS, parallel_tool_calls=False, seed=force(rt, text)).choices[0].message
    assert calls_of(one) == both[:1]


MALFORMED = '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>'


@pytest.mark.parametrize("stream", [False, True])
def test_malformed_call_and_tool_choice_none_come_back_as_content(template_servers, force, stream):
    srv = template_servers(*QWEN3)
    rt = srv.service.runtime
    for text, kw in [(MALFORMED, {}), (JSON_CALL, {"tool_choice": "none"})]:
        seed = force(rt, "<think>\n\n</think>\n\n" + text)
        if stream:
            final, _, _ = streamed(srv, ASK, tools=TOOLS, seed=seed, **kw)
            choice = final.choices[0]
        else:
            choice = create(srv, ASK, tools=TOOLS, seed=seed, **kw).choices[0]
        assert choice.finish_reason == "stop" and not choice.message.tool_calls
        assert choice.message.content == text


def test_enable_thinking_off_and_reasoning_without_tools(template_servers, force):
    srv = template_servers(*QWEN35)
    rt = srv.service.runtime
    resp = create(srv, ASK, seed=force(rt, "Quick thought.\n</think>\n\nParis is sunny."))
    assert resp.choices[0].message.content == "Paris is sunny."
    assert extra(resp.choices[0].message, "reasoning_content") == "Quick thought."
    off = create(
        srv, ASK, seed=force(rt, "Paris is sunny."), extra_body={"chat_template_kwargs": {"enable_thinking": False}}
    )
    assert off.choices[0].message.content == "Paris is sunny."
    assert extra(off.choices[0].message, "reasoning_content") is None
    assert off.usage.prompt_tokens == resp.usage.prompt_tokens + 4  # the prompt closes the block: "\n\n</think>\n\n"


@pytest.mark.parametrize("pair", [QWEN35, QWEN3, LLAMA3], ids=["qwen3.5-xml", "qwen3-hermes", "llama3-json"])
def test_model_output_shapes(template_servers, pair):
    """The model's own (random-weight) greedy output: whatever it is, the response has the API's shape, the
    tools are in the prompt, and streamed and whole replies agree."""
    srv = template_servers(*pair)
    rt = srv.service.runtime
    resp = create(srv, ASK, tools=TOOLS, tool_choice="auto", max_tokens=24)
    assert resp.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert resp.choices[0].message.role == "assistant"
    plain = rt.render_chat([template_message(m) for m in ASK], True)
    assert resp.usage.prompt_tokens == len(rt.render_chat(ASK, True, template_kwargs={"tools": TOOLS})) > len(plain)
    final, reasoning, _ = streamed(srv, ASK, tools=TOOLS, max_tokens=24)
    m = resp.choices[0].message
    assert (final.choices[0].message.content, calls_of(final.choices[0].message), reasoning or None) == (
        m.content,
        calls_of(m),
        extra(m, "reasoning_content"),
    )


@pytest.mark.parametrize(
    "body,param",
    [
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": TOOLS}, "tool_choice"),
        ({"chat_template_kwargs": {"chat_template": "{{ 'x' }}"}}, "chat_template_kwargs"),
        ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
        ({"tools": [{"type": "retrieval"}]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools"),
        ({"tool_choice": "sometimes", "tools": TOOLS}, "tool_choice"),
        (
            {
                "messages": [
                    *ASK,
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {
                                "id": "c",
                                "type": "function",
                                "function": {"name": "get_weather", "arguments": "not json"},
                            }
                        ],
                    },
                ]
            },
            "messages",
        ),  # the Qwen3.5 template needs a mapping
        ({"messages": [*ASK, {"role": "assistant", "tool_calls": [{"id": "c", "type": "function"}]}]}, "messages"),
    ],
)
def test_bad_tool_requests_are_400(template_servers, body, param):
    srv = template_servers(*QWEN35)
    r = httpx.post(
        f"{srv.base_url}/v1/chat/completions",
        json={"model": "tpl", "messages": ASK, "max_tokens": 2, **body},
        timeout=30,
    )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] is not None and err["param"].split(".")[0] == param and err["message"], err


def test_required_and_named_tool_choice_are_accepted(template_servers, force):
    srv = template_servers(*QWEN35)
    rt = srv.service.runtime
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        resp = create(srv, ASK, tools=TOOLS, tool_choice=choice, seed=force(rt, "ok\n</think>\n\n" + XML_CALL))
        assert calls_of(resp.choices[0].message) == [("get_weather", PARIS)]

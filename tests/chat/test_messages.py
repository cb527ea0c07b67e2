"""Wire messages reach the real templates (tool calls with JSON-string arguments, tool results, reasoning
sent back), and a parsed reply, sent back as the client sends it, renders as the tokens the model wrote."""

import json

import pytest

from hyserve.chat import ChatTurn, template_message
from hyserve.parsers import choose_parsers
from hyserve.testing.tiny import train_tokenizer, use_template

from ..conftest import LLAMA3_TEMPLATE, QWEN3_TEMPLATE, QWEN35_TEMPLATE, real_template
from ..parsers.helpers import TOOLS


def tokenizer_for(name):
    return use_template(train_tokenizer(), real_template(name).read_text())


def render(tok, messages, gen, tools=TOOLS, **kw):
    return tok.apply_chat_template(
        [template_message(m) for m in messages], tokenize=False, add_generation_prompt=gen, tools=tools, **kw
    )


CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "days": 3})},
}
AGENT = [  # as an OpenAI client sends it: arguments a JSON string, content None beside tool calls
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "reasoning_content": "Need the tool.", "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
]


def test_template_message():
    assert template_message(AGENT[2]) == {
        "role": "assistant",
        "content": "",
        "reasoning_content": "Need the tool.",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}},
            }
        ],
    }
    assert template_message({"role": "assistant", "content": "x", "reasoning": "r"})["reasoning_content"] == "r"
    odd = {**CALL, "function": {"name": "f", "arguments": "not json"}}
    assert (
        template_message({"role": "assistant", "tool_calls": [odd]})["tool_calls"][0]["function"]["arguments"]
        == "not json"
    )
    assert template_message(AGENT[3]) == {"role": "tool", "content": "sunny, 21 C", "tool_call_id": "call_1"}
    assert template_message(
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    ) == {"role": "user", "content": "ab"}


@pytest.mark.parametrize(
    "name,expected",
    [
        (
            QWEN35_TEMPLATE,
            "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>"
            "\n3\n</parameter>\n</function>\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n"
            "sunny, 21 C\n</tool_response><|im_end|>\n",
        ),
        (
            QWEN3_TEMPLATE,
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'
            "<|im_end|>\n<|im_start|>user\n<tool_response>\nsunny, 21 C\n</tool_response><|im_end|>\n",
        ),
        (
            LLAMA3_TEMPLATE,
            '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}<|eot_id|>'
            '<|start_header_id|>ipython<|end_header_id|>\n\n"sunny, 21 C"<|eot_id|>',
        ),
    ],
)
def test_history_with_tool_calls_renders_through_real_templates(name, expected):
    text = render(tokenizer_for(name), AGENT, gen=True)
    assert expected in text and '"name": "get_weather"' in text  # the call, and the tool in the prompt


def test_reasoning_sent_back_reaches_the_template():
    tok = tokenizer_for(QWEN35_TEMPLATE)
    text = render(tok, AGENT, gen=False)
    assert "<|im_start|>assistant\n<think>\nNeed the tool.\n</think>\n\n<tool_call>" in text
    vllm_name = [*AGENT[:2], {**AGENT[2], "reasoning_content": None, "reasoning": "Need the tool."}, AGENT[3]]
    assert render(tok, vllm_name, gen=False) == text


def test_enable_thinking_off_reaches_the_template():
    tok = tokenizer_for(QWEN35_TEMPLATE)
    assert render(tok, AGENT[:2], True).endswith("<|im_start|>assistant\n<think>\n")
    assert render(tok, AGENT[:2], True, enable_thinking=False).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )


# (template, prompt opens <think>, end of turn, a reply in the template's own format)
REPLIES = [
    (
        QWEN35_TEMPLATE,
        True,
        "<|im_end|>\n",
        "The user wants weather.\n</think>\n\nChecking.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\n"
        "Paris\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
    ),
    (
        QWEN3_TEMPLATE,
        False,
        "<|im_end|>\n",
        '<think>\nThe user wants weather.\n</think>\n\nChecking.\n<tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Paris", "days": 3}}\n</tool_call>',
    ),
    (LLAMA3_TEMPLATE, False, "<|eot_id|>", '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}'),
]


@pytest.mark.parametrize("name,opens,end,reply", REPLIES)
def test_parsed_reply_sent_back_renders_as_generated(name, opens, end, reply):
    """What the lead's post-decode re-render builds on: the reply read into a message, as the client sends it
    back, renders (as the conversation's last turn) to exactly the prompt plus the generated text."""
    tok = tokenizer_for(name)
    turn = ChatTurn(choose_parsers(tok.chat_template), tools=TOOLS)
    messages = AGENT[:2]
    prompt = render(tok, messages, gen=True)
    turn.note_prompt(tok, tok(prompt, add_special_tokens=False)["input_ids"])
    assert turn.reasoning_opened is opens
    sent_back = turn.assistant_message(reply)
    assert sent_back["tool_calls"][0]["function"] == {
        "name": "get_weather",
        "arguments": '{"city": "Paris", "days": 3}',
    }
    assert turn.history_message(reply) == template_message(sent_back)
    assert render(tok, [*messages, sent_back], gen=False) == prompt + reply + end

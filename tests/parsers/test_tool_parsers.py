"""Each tool-call format on fixed model outputs: calls parsed, text around them kept as content, malformed
calls returned as content, and every chunking of the stream giving what the whole text gives."""

import pytest

from hyserve.parsers.hermes import HermesParser
from hyserve.parsers.llama3_json import Llama3JsonParser
from hyserve.parsers.qwen3_xml import Qwen3XmlParser, convert
from hyserve.parsers.reasoning import ThinkParser
from hyserve.parsers.registry import choose_parsers

from .helpers import parsed, turn

W = ("get_weather", {"city": "Paris", "days": 3})
HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'

HERMES = [
    (HERMES_CALL, None, [W]),
    ("Let me check.\n" + HERMES_CALL, "Let me check.", [W]),
    (
        HERMES_CALL + "\n" + HERMES_CALL.replace("Paris", "Rome"),
        None,
        [W, ("get_weather", {"city": "Rome", "days": 3})],
    ),
    # arguments sent as a JSON string, and "parameters" as the key: both read
    (
        '<tool_call>{"name": "run_code", "arguments": "{\\"code\\": \\"print(1)\\"}"}</tool_call>',
        None,
        [("run_code", {"code": "print(1)"})],
    ),
    ('<tool_call>{"name": "run_code", "parameters": {}}</tool_call>', None, [("run_code", {})]),
    ('<tool_call>{"name": "run_code"}</tool_call>', None, [("run_code", {})]),
    # the reply ends inside a block whose JSON is whole: still a call
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}', None, [W]),
    # unicode and a closing tag's look-alike inside the arguments
    (
        '<tool_call>{"name": "run_code", "arguments": {"code": "x = \\"東京 </tool\\""}}</tool_call>',
        None,
        [("run_code", {"code": 'x = "東京 </tool"'})],
    ),
    ("no calls here", "no calls here", []),
    ("a <tool that is not a tag, and <tool_call", "a <tool that is not a tag, and <tool_call", []),
]
HERMES_MALFORMED = [
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>',  # bad JSON
    '<tool_call>\n{"arguments": {"city": "Paris"}}\n</tool_call>',  # no name
    '<tool_call>\n{"name": "get weather", "arguments": {}}\n</tool_call>',  # not a function name
    '<tool_call>\n{"name": "f", "arguments": [1, 2]}\n</tool_call>',  # arguments not an object
    '<tool_call>\n["get_weather"]\n</tool_call>',
    '<tool_call>\n{"name": "get_weather", "argu',  # cut off by max_tokens
    "<tool_call></tool_call>",
]


@pytest.mark.parametrize("text,content,calls", HERMES)
def test_hermes(text, content, calls):
    assert parsed(turn(HermesParser), text) == (content, None, calls)


@pytest.mark.parametrize("text", HERMES_MALFORMED)
def test_hermes_malformed_is_content(text):
    assert parsed(turn(HermesParser), text) == (text, None, [])


def test_hermes_one_good_one_malformed():
    bad = '<tool_call>{"name": "x", "arguments": {</tool_call>'
    assert parsed(turn(HermesParser), HERMES_CALL + "\n" + bad) == (bad, None, [W])


def test_parallel_tool_calls_false_keeps_the_first():
    text = HERMES_CALL + "\n" + HERMES_CALL.replace("Paris", "Rome")
    assert parsed(turn(HermesParser, parallel_tool_calls=False), text) == (None, None, [W])


def test_no_tools_or_tool_choice_none_parses_nothing():
    assert parsed(turn(HermesParser, tools=None), HERMES_CALL) == (HERMES_CALL, None, [])
    assert parsed(turn(HermesParser, tool_choice="none"), HERMES_CALL) == (HERMES_CALL, None, [])


XML_CALL = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
)
CODE = "def f(x):\n    return x + 1\n"
XML = [
    (XML_CALL, None, [W]),
    ("I will look it up.\n\n" + XML_CALL, "I will look it up.", [W]),
    (XML_CALL + "\n" + XML_CALL.replace("Paris", "Rome"), None, [W, ("get_weather", {"city": "Rome", "days": 3})]),
    # multi-line values keep their own newlines
    (
        f"<tool_call>\n<function=run_code>\n<parameter=code>\n{CODE}\n</parameter>\n</function>\n</tool_call>",
        None,
        [("run_code", {"code": CODE})],
    ),
    # typed by the tool's schema
    (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\n42\n</parameter>\n<parameter=metric>\nTrue\n"
        '</parameter>\n<parameter=ratio>\n0.5\n</parameter>\n<parameter=tags>\n["a", 1]\n</parameter>\n'
        '<parameter=opts>\n{"k": null}\n</parameter>\n<parameter=note>\nnull\n</parameter>\n</function>\n'
        "</tool_call>",
        None,
        [
            (
                "get_weather",
                {"city": "42", "metric": True, "ratio": 0.5, "tags": ["a", 1], "opts": {"k": None}, "note": None},
            )
        ],
    ),
    # a missing </parameter> ends at the next parameter; no parameters at all; the reply ends inside the block
    (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n<parameter=days>\n3\n</parameter>\n"
        "</function>\n</tool_call>",
        None,
        [W],
    ),
    ("<tool_call>\n<function=run_code>\n</function>\n</tool_call>", None, [("run_code", {})]),
    (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n"
        "</parameter>\n</function>\n",
        None,
        [W],
    ),
]
XML_MALFORMED = [
    '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>',  # JSON: another format
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</tool_call>",  # no </function>
    "<tool_call>\n<function=get_weather>\nParis\n</function>\n</tool_call>",  # text outside a parameter
    "<tool_call>\n<function=>\n</function>\n</tool_call>",
    "<tool_call>\n<function=get_weather>\n<parameter=>\nx\n</parameter>\n</function>\n</tool_call>",
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar",  # cut off
]


@pytest.mark.parametrize("text,content,calls", XML)
def test_qwen3_xml(text, content, calls):
    assert parsed(turn(Qwen3XmlParser), text) == (content, None, calls)


@pytest.mark.parametrize("text", XML_MALFORMED)
def test_qwen3_xml_malformed_is_content(text):
    assert parsed(turn(Qwen3XmlParser), text) == (text, None, [])


def test_qwen3_xml_without_a_schema_keeps_strings():
    assert parsed(
        turn(Qwen3XmlParser, tools=[{"type": "function", "function": {"name": "get_weather"}}]), XML_CALL
    ) == (None, None, [("get_weather", {"city": "Paris", "days": "3"})])


@pytest.mark.parametrize(
    "value,schema,out",
    [
        ("3", {"type": "integer"}, 3),
        ("3.0", {"type": "integer"}, "3.0"),
        ("7", {"type": "number"}, 7),
        ("1e3", {"type": "number"}, 1000.0),
        ("nan", {"type": "number"}, "nan"),
        ("yes", {"type": "boolean"}, "yes"),
        ("FALSE", {"type": "boolean"}, False),
        ("[1]", {"type": "object"}, "[1]"),
        ("null", {"type": "integer"}, "null"),
        (" x ", {"type": "string"}, " x "),
        ("5", None, "5"),
        ("5", {"type": ["integer", "string"]}, "5"),
    ],
)
def test_xml_value_conversion(value, schema, out):
    assert convert(value, schema) == out and type(convert(value, schema)) is type(out)


LLAMA_CALL = '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}'
LLAMA = [
    (LLAMA_CALL, None, [W]),
    ("<|python_tag|>" + LLAMA_CALL, None, [W]),
    ("\n " + LLAMA_CALL + " ", None, [W]),
    (LLAMA_CALL + "; " + LLAMA_CALL.replace("Paris", "Rome"), None, [W, ("get_weather", {"city": "Rome", "days": 3})]),
    ('{"name": "run_code", "arguments": {"code": "1"}}', None, [("run_code", {"code": "1"})]),
    ("The answer is {x}.", "The answer is {x}.", []),
    ("<|python", "<|python", []),
]
LLAMA_MALFORMED = [
    '{"not": "a call"}',
    LLAMA_CALL + " and then some",
    '{"name": "get_weather", "parameters": {',
    LLAMA_CALL + ";",
    '{"name": "f", "parameters": "x"}',
]


@pytest.mark.parametrize("text,content,calls", LLAMA)
def test_llama3_json(text, content, calls):
    assert parsed(turn(Llama3JsonParser), text) == (content, None, calls)


@pytest.mark.parametrize("text", LLAMA_MALFORMED)
def test_llama3_json_malformed_is_content(text):
    assert parsed(turn(Llama3JsonParser), text) == (text.strip(), None, [])


@pytest.mark.parametrize("parser,call", [(HermesParser, HERMES_CALL), (Qwen3XmlParser, XML_CALL)])
def test_calls_after_reasoning_and_not_inside_it(parser, call):
    text = f"I should call it: {call}\n</think>\n\n{call}"
    content, reasoning, calls = parsed(turn(parser, ThinkParser, opened=True), text)
    assert reasoning == f"I should call it: {call}" and content is None and calls == [W]


def test_parsers_chosen_from_the_template_and_overridden():
    assert choose_parsers("<tool_call>\n<function=x>\n<parameter=p>\n</tool_call> </think>").names == {
        "tool_call_parser": "qwen3_xml",
        "reasoning_parser": "think",
    }
    assert choose_parsers("<tool_call>{json}</tool_call>").names == {
        "tool_call_parser": "hermes",
        "reasoning_parser": None,
    }
    assert choose_parsers("plain ChatML").names == {"tool_call_parser": None, "reasoning_parser": None}
    assert choose_parsers("<tool_call></tool_call></think>", "qwen3_coder", "none").names == {
        "tool_call_parser": "qwen3_xml",
        "reasoning_parser": None,
    }
    with pytest.raises(ValueError, match="unknown tool-call parser 'nope'"):
        choose_parsers("", "nope")

"""Which chat templates render one tool call per assistant message, found by rendering at load: the real
Llama 3.1 template refuses two, one that drops the second call is caught too, the others render both."""

import pytest

from hyserve.chat import ChatTurn
from hyserve.chat.call_limit import renders_parallel_calls
from hyserve.parsers import Parsers
from hyserve.parsers.llama3_json import Llama3JsonParser
from hyserve.testing.tiny import train_tokenizer, use_template

from ..conftest import TEMPLATES_DIR, real_template
from ..parsers.helpers import TOOLS, parsed

DROPS_LATER_CALLS = (
    "{% for m in messages %}{{ m.role }}: {{ m.content }}{% if m.tool_calls %}"
    "{{ m.tool_calls[0].function.name }}{% endif %}\n{% endfor %}"
)
NO_TOOLS = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
WANTS_RESULTS = (
    "{% if messages[-1].role == 'assistant' %}{{ raise_exception('results first') }}{% endif %}" + DROPS_LATER_CALLS
)  # a template that wants a result after the calls


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer()


@pytest.mark.parametrize("name", sorted(p.name for p in TEMPLATES_DIR.glob("*.jinja")) or ["none"])
def test_real_templates(tokenizer, name):
    template = real_template(name).read_text()
    assert renders_parallel_calls(use_template(tokenizer, template)) == ("Llama-3" not in name)


@pytest.mark.parametrize("template,parallel", [(DROPS_LATER_CALLS, False), (WANTS_RESULTS, False), (NO_TOOLS, True)])
def test_written_templates(tokenizer, template, parallel):
    assert renders_parallel_calls(use_template(tokenizer, template)) == parallel


def test_one_call_per_reply_on_such_templates_even_with_parallel_tool_calls():
    call = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    text = call + "; " + call.replace("Paris", "Rome")
    both = [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})]
    assert parsed(ChatTurn(Parsers(Llama3JsonParser, None), TOOLS), text) == (None, None, both)
    single = ChatTurn(Parsers(Llama3JsonParser, None, single_tool_call=True), TOOLS, parallel_tool_calls=True)
    assert parsed(single, text) == (None, None, both[:1])

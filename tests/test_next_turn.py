"""The next turn's history with real chat templates: the reply rendered as an earlier message is a token
prefix of the next turn's prompt, for templates that render the last message differently (Qwen3 and
Qwen3.5 drop reasoning of earlier turns, Llama 3.1 trims content)."""

import re
from pathlib import Path

import pytest

from hyserve.prompt import next_turn
from hyserve.testing.tiny import train_tokenizer

TEMPLATES = Path(__file__).resolve().parents[1].parent / "shared" / "fixtures" / "chat_templates"
NAMES = [
    "Qwen3.5-4B.jinja",
    "Qwen-Qwen3-0.6B.jinja",
    "meta-llama-Llama-3.1-8B-Instruct.jinja",
    "ibm-granite-granite-4.0.jinja",
    "NVIDIA-Nemotron-Nano-v2.jinja",
    "LFM2.5-Instruct.jinja",
]
# templates that render the last assistant message differently from an earlier one (its reasoning)
DROPS_REASONING = {"Qwen3.5-4B.jinja", "Qwen-Qwen3-0.6B.jinja"}


def _tokenizer(template: str):
    """The tiny BPE with the template's control strings as special tokens and its tags as plain added
    tokens (as the real tokenizers have them)."""
    tok = train_tokenizer()
    special = sorted(set(re.findall(r"<\|[a-z_]+\|>|<SPECIAL_\d+>", template)))
    tags = sorted(set(re.findall(r"</?(?:think|tool_call|tool_response|tools)>", template)))
    tok.add_special_tokens({"additional_special_tokens": special, "bos_token": "<|begin_of_text|>"})
    tok.add_tokens(tags)
    tok.chat_template = template
    return tok


def _render_many(tok, tools=None):
    def render(items):
        out = []
        for messages, gen in items:
            try:
                out.append(
                    tok.apply_chat_template(
                        messages, tools=tools, tokenize=True, add_generation_prompt=gen, return_dict=False
                    )
                )
            except Exception as exc:
                out.append(exc)
        return out

    return render


def _template(name: str) -> str:
    path = TEMPLATES / name
    if not path.exists():
        pytest.skip("../shared/fixtures/chat_templates is absent")
    return path.read_text()


CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2 + 2?"}]
THINKING_REPLY = {"role": "assistant", "content": "<think>\nAdd them.\n</think>\n\n  The answer is 4.  "}


@pytest.mark.parametrize("name", NAMES)
def test_the_reply_as_an_earlier_message_is_a_prefix_of_the_next_prompt(name):
    tok = _tokenizer(_template(name))
    render = _render_many(tok)
    specials = next_turn.special_ids(tok)
    history = next_turn.history_ids(CHAT + [THINKING_REPLY], render, specials)
    (this_prompt,) = render([(CHAT, True)])
    for follow_up in ("And 3 + 3?", "  <think>no</think> x"):
        (next_prompt,) = render([(CHAT + [THINKING_REPLY, {"role": "user", "content": follow_up}], True)])
        assert next_prompt[: len(history)] == history, name
    assert len(history) > len(this_prompt)  # it holds the reply: the next turn starts past it
    (as_last,) = render([(CHAT + [THINKING_REPLY], False)])
    if name in DROPS_REASONING:  # what hyserve rendered before: a sequence no next turn sends
        assert next_prompt[: len(as_last)] != as_last


@pytest.mark.parametrize("name", ["Qwen3.5-4B.jinja", "Qwen-Qwen3-0.6B.jinja"])
def test_a_tool_call_reply_is_a_prefix_of_the_turn_with_its_result(name):
    tok = _tokenizer(_template(name))
    tools = [
        {
            "type": "function",
            "function": {
                "name": "add",
                "description": "Add two numbers",
                "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}},
            },
        }
    ]
    render = _render_many(tok, tools)
    call = {
        "role": "assistant",
        "content": "<think>\nUse the tool.\n</think>\n\n",
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 2}}}
        ],
    }
    history = next_turn.history_ids(CHAT + [call], render, next_turn.special_ids(tok))
    (next_prompt,) = render([(CHAT + [call, {"role": "tool", "tool_call_id": "call_1", "content": "4"}], True)])
    assert next_prompt[: len(history)] == history
    (this_prompt,) = render([(CHAT, True)])
    assert len(history) > len(this_prompt)


def test_no_special_token_before_the_next_message_gives_no_history():
    plain = [[1, 2, 3, 4], [1, 2, 3, 5]]
    with pytest.raises(ValueError):
        next_turn.history_ids(CHAT + [THINKING_REPLY], lambda items: plain, frozenset({99}))

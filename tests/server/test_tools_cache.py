"""Cache on == cache off (greedy, token for token) for agent chats whose history holds reasoning, tool calls
and tool results, rendered with the real Qwen3.5 and Qwen3 templates on tiny models, through the `openai`
client. Tool-calling turns are forced (`force`); the turns compared are the model's own greedy replies,
which read the state the cache restored.

Reuse, with idle time between turns: a turn is served from cache up to its whole history (the previous
messages and reply as this turn renders them), or at least up to the state the previous reply left (its
prompt and generated tokens, the end-of-turn token not run), which is a prefix of that history. That holds
on every turn, for the recurrent model (Qwen3.5) and the attention-only one (Qwen3) alike: a reply that
does not re-render as generated (after a new user query the Qwen3 template drops the `<think>` block of
the earlier tool-calling turn) is rebuilt in idle time."""

import pytest

from hyserve.chat import template_message

from ..conftest import wait_idle
from .test_tools_reasoning import ASK, JSON_CALL, QWEN3, QWEN35, TOOLS, XML_CALL, create

RESULT = "Paris: sunny, 21 C, light breeze from the west; tomorrow rain. " * 6  # a tool result of some length

TURNS = {  # per template: (forced reply or None for greedy, what the client adds after the reply)
    QWEN35: [
        ("The user wants weather.\n</think>\n\nChecking.\n\n" + XML_CALL, "tool"),
        (None, "user"),
        ("Two cities now.\n</think>\n\n" + XML_CALL + "\n" + XML_CALL.replace("Paris", "Rome"), "tool"),
        (None, "user"),
        (None, None),
    ],
    QWEN3: [
        ("<think>\nThe user wants weather.\n</think>\n\nChecking.\n" + JSON_CALL, "tool"),
        (None, "user"),
        ("<think>\nTwo cities now.\n</think>\n\n" + JSON_CALL + "\n" + JSON_CALL.replace("Paris", "Rome"), "tool"),
        (None, "user"),
        (None, None),
    ],
}


def agent_chat(srv, force, pair):
    """Run the scripted chat; per turn (greedy token ids or None, cached tokens, the state the previous reply
    left, the whole history the turn's prompt starts with, whether the turn follows a tool result)."""
    rt = srv.service.runtime
    kwargs = {"tools": TOOLS}
    messages, out, previous = list(ASK), [], None
    for forced, then in TURNS[pair]:
        wait_idle(srv.service)
        extra = {"seed": force(rt, forced)} if forced else {"max_tokens": 10}
        resp = create(srv, messages, tools=TOOLS, extra_body={"return_token_ids": True}, **extra)
        state = whole = 0
        if previous is not None:
            state = previous[2].prompt_tokens + previous[2].completion_tokens - 1
            whole = len(
                rt.render_next_turn([template_message(m) for m in previous[0] + [previous[1]]], template_kwargs=kwargs)
            )
        out.append(
            (
                None if forced else resp.choices[0].model_extra["token_ids"],
                resp.usage.prompt_tokens_details.cached_tokens,
                state,
                whole,
                messages[-1]["role"] == "tool",
            )
        )
        reply = resp.choices[0].message.model_dump(exclude_none=True)
        previous = (list(messages), reply, resp.usage)
        messages.append(reply)
        if then == "tool":
            assert resp.choices[0].finish_reason == "tool_calls"
            messages += [{"role": "tool", "tool_call_id": c["id"], "content": RESULT} for c in reply["tool_calls"]]
        elif then == "user":
            messages.append({"role": "user", "content": "Thanks. What should I wear?"})
    return out


@pytest.mark.parametrize("pair", [QWEN35, QWEN3], ids=["qwen3.5", "qwen3"])
def test_agent_chat_cache_on_equals_off(template_servers, force, pair):
    on = agent_chat(template_servers(*pair), force, pair)
    off = agent_chat(template_servers(*pair, cache_enabled=False), force, pair)
    assert [t[0] for t in on] == [t[0] for t in off]  # greedy replies identical, token for token
    assert all(t[1] == 0 for t in off)
    for i, (_, cached, state, whole, after_tool) in enumerate(on[1:], start=2):
        assert cached > 0, (i, on)
        assert cached >= min(state, whole), (i, on, after_tool)

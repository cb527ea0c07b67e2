"""Agent loops sent back to back, as agent frameworks send them: the next request goes out the instant the
previous reply (and the tool's result) is ready, with no idle time for the engine. Every request after the
first must reuse at least 0.98 of its history (the prompt tokens that do not depend on its new trailing
messages), whether the client sends the model's reasoning back or drops it, on the real Qwen3.5, Qwen3 and
Llama 3.1 templates, on a hybrid model (Qwen3.5's Gated DeltaNet layers) and an attention-only one; and the
model's own greedy replies equal those of a server with the cache off, token for token.

Tool-calling and answer turns are forced (`force`): the real engine decodes the scripted tokens."""

import pytest

from hyserve.chat import template_message

from ..conftest import LLAMA3_TEMPLATE, QWEN3_TEMPLATE, QWEN35_TEMPLATE
from .test_tools_reasoning import ASK, TOOLS, create

XML = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\n{city}\n</parameter>\n<parameter=days>\n3\n"
    "</parameter>\n</function>\n</tool_call>"
)
JSON = '<tool_call>\n{{"name": "get_weather", "arguments": {{"city": "{city}", "days": 3}}}}\n</tool_call>'
PYTHON_TAG = '<|python_tag|>{{"name": "get_weather", "parameters": {{"city": "{city}", "days": 3}}}}'
RESULT = "{city}: sunny, 21 C, light breeze from the west; tomorrow rain and 14 C. " * 4

# Per template: how a reply with reasoning, content and a call is written after the generation prompt.
STYLES = {
    QWEN35_TEMPLATE: lambda why, text, call: f"{why}\n</think>\n\n{text}" + (f"\n\n{call}" if call else ""),
    QWEN3_TEMPLATE: lambda why, text, call: f"<think>\n{why}\n</think>\n\n{text}" + (f"\n{call}" if call else ""),
    LLAMA3_TEMPLATE: lambda why, text, call: call or text,  # no reasoning; a call is the whole reply
}
CALLS = {QWEN35_TEMPLATE: XML, QWEN3_TEMPLATE: JSON, LLAMA3_TEMPLATE: PYTHON_TAG}

# The script: (reasoning, content, city called or None; None for the model's own greedy reply), then what
# the client adds: a tool result, or a new user message.
SCRIPT = [
    (("The user wants weather.", "Checking.", "Paris"), "tool"),
    (("One more city.", "And Rome.", "Rome"), "tool"),
    (("Both are known now.", "Paris and Rome are sunny.", None), "user"),
    (None, "user"),
    (("A new city.", "Checking Oslo.", "Oslo"), "tool"),
    (("Done.", "Oslo is sunny too.", None), "user"),
    (None, None),
]


def agent_loop(srv, force, template: str, sends_reasoning: bool, first=ASK) -> list[tuple]:
    """Run the script back to back; per request (greedy token ids or None, cached tokens, history tokens)."""
    rt = srv.service.runtime
    messages, out = list(first), []
    for step, then in SCRIPT:
        if step is None:
            extra = {"max_tokens": 8}
        else:
            why, text, city = step
            call = CALLS[template].format(city=city) if city else None
            extra = {"seed": force(rt, STYLES[template](why, text, call))}
        history = 0
        if len(messages) > len(first):  # the messages before this request's new trailing ones, as it renders them
            last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
            history = len(
                rt.render_next_turn(
                    [template_message(m) for m in messages[: last + 1]], template_kwargs={"tools": TOOLS}
                )
            )
        resp = create(srv, messages, tools=TOOLS, extra_body={"return_token_ids": True}, **extra)
        choice = resp.choices[0]
        out.append(
            (None if step else choice.model_extra["token_ids"], resp.usage.prompt_tokens_details.cached_tokens, history)
        )
        reply = choice.message.model_dump(exclude_none=True)
        if not sends_reasoning:  # openai-agents' and LangChain's habit: the reasoning is not sent back
            reply.pop("reasoning_content", None)
            reply.pop("reasoning", None)
        messages.append(reply)
        if then == "tool":
            assert choice.finish_reason == "tool_calls", choice
            messages += [
                {"role": "tool", "tool_call_id": c["id"], "content": RESULT.format(city=city)}
                for c in reply["tool_calls"]
            ]
        elif then == "user":
            messages.append({"role": "user", "content": "Thanks. What should I wear there?"})
    return out


PAIRS = [
    ("qwen3_5", QWEN35_TEMPLATE),
    ("qwen3_5", QWEN3_TEMPLATE),
    ("qwen3_5", LLAMA3_TEMPLATE),
    ("qwen3", QWEN3_TEMPLATE),
]


@pytest.mark.parametrize("sends_reasoning", [True, False], ids=["reasoning-sent", "reasoning-dropped"])
@pytest.mark.parametrize(
    "pair", PAIRS, ids=["qwen3.5", "qwen3.5-model-qwen3-template", "qwen3.5-model-llama3.1-template", "qwen3"]
)
def test_back_to_back_agent_reuses_its_whole_history(template_servers, force, pair, sends_reasoning):
    on = agent_loop(template_servers(*pair), force, pair[1], sends_reasoning)
    off = agent_loop(template_servers(*pair, cache_enabled=False), force, pair[1], sends_reasoning)
    assert [t[0] for t in on] == [t[0] for t in off]  # the model's own replies, token for token
    assert all(t[1] == 0 for t in off)
    ratios = [round(cached / history, 3) for _, cached, history in on[1:]]
    assert min(ratios) >= 0.98, (ratios, on)


LFM2_TEMPLATE, NEMOTRON_TEMPLATE, GRANITE_TEMPLATE = (
    "LFM2.5-Instruct.jinja",
    "NVIDIA-Nemotron-Nano-v2.jinja",
    "ibm-granite-granite-4.0.jinja",
)
CHAT = [
    "Sure, here is a short answer about the weather: sunny and mild.",
    None,
    "Paris is the capital of France and its largest city.",
    None,
    "That is all.",
    None,
]


def chat_loop(srv, force) -> list[tuple]:
    """A chat of forced and greedy replies, each next turn sent the instant the reply arrives."""
    rt = srv.service.runtime
    messages, out = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello!"}], []
    for text in CHAT:
        history = 0
        if len(messages) > 2:
            history = len(rt.render_next_turn([template_message(m) for m in messages[:-1]]))
        extra = {"seed": force(rt, text)} if text else {"max_tokens": 8}
        resp = create(srv, messages, extra_body={"return_token_ids": True}, **extra)
        choice = resp.choices[0]
        out.append(
            (None if text else choice.model_extra["token_ids"], resp.usage.prompt_tokens_details.cached_tokens, history)
        )
        messages += [choice.message.model_dump(exclude_none=True), {"role": "user", "content": "And then?"}]
    return out


@pytest.mark.parametrize(
    "pair",
    [("lfm2", LFM2_TEMPLATE), ("nemotron_h", NEMOTRON_TEMPLATE), ("granitemoehybrid", GRANITE_TEMPLATE)],
    ids=["lfm2", "nemotron-h", "granite-4.0"],
)
def test_back_to_back_chat_reuses_its_whole_history_on_every_template(template_servers, force, pair):
    """The other real templates, on their own hybrid families (which cannot capture a state inside a pass: the
    prefill is split at each boundary)."""
    on = chat_loop(template_servers(*pair), force)
    off = chat_loop(template_servers(*pair, cache_enabled=False), force)
    assert [t[0] for t in on] == [t[0] for t in off]
    ratios = [round(cached / history, 3) for _, cached, history in on[1:]]
    assert min(ratios) >= 0.98, (ratios, on)


def test_agents_side_by_side_each_reuse_their_whole_history(template_servers, force):
    """Three agents at once, each back to back: their jobs pause for each other's requests (recording where they
    stand) and each next turn waits for its own; every request still reuses its whole history, and the greedy
    replies equal the cache-off server's."""
    import threading

    pair = ("qwen3_5", QWEN35_TEMPLATE)
    firsts = [[{"role": "system", "content": f"You are agent {i}. Be terse."}, ASK[1]] for i in range(3)]

    def together(srv):
        out, errors = [None] * 3, []

        def one(i):
            try:
                out[i] = agent_loop(srv, force, pair[1], i != 1, first=firsts[i])
            except Exception as exc:  # (reported below, with the others' results)
                errors.append(exc)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)
        assert not errors, errors
        return out

    on, off = together(template_servers(*pair)), together(template_servers(*pair, cache_enabled=False))
    for a, b in zip(on, off):
        assert [t[0] for t in a] == [t[0] for t in b]
        ratios = [round(cached / history, 3) for _, cached, history in a[1:]]
        assert min(ratios) >= 0.98, (ratios, a)

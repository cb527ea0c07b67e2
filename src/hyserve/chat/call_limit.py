"""Whether a chat template can render an assistant message with several tool calls.

Some cannot: Llama 3.x's raises "This model only supports single tool-calls at once!", others would drop
every call after the first. A reply with two calls would then make the client's next request fail (a 400 on
a history the template refuses) or silently lose a call, so the server replies with one call on such
templates, whatever `parallel_tool_calls` says (`ChatTurn.reader`). Found once at load by rendering a
history with one call and with two: a template that renders the first but not both cannot.
"""

from __future__ import annotations

import logging

from .messages import template_message

log = logging.getLogger(__name__)

_NAMES = ("hyserve_probe_first", "hyserve_probe_second")


def _history(calls: int) -> list[dict]:
    """An agent's turn as clients send it back: the calls, then a result for each (templates may insist)."""
    tool_calls = [
        {"id": f"call{i}", "type": "function", "function": {"name": name, "arguments": "{}"}}
        for i, name in enumerate(_NAMES[:calls])
    ]
    return [
        {"role": "user", "content": "Hi"},
        template_message({"role": "assistant", "content": "", "tool_calls": tool_calls}),
        *[template_message({"role": "tool", "tool_call_id": c["id"], "content": "ok"}) for c in tool_calls],
    ]


def _render(tokenizer, calls: int) -> str | None:
    try:
        text = tokenizer.apply_chat_template(_history(calls), tokenize=False, add_generation_prompt=True)
    except Exception:  # any template error: the template refuses this history
        return None
    return text if isinstance(text, str) else None


def renders_parallel_calls(tokenizer) -> bool:
    """False when the template renders one tool call per assistant message but not two; True otherwise
    (also when it renders no tool call at all: nothing to learn from it)."""
    one = _render(tokenizer, 1)
    if one is None or _NAMES[0] not in one:
        return True
    two = _render(tokenizer, 2)
    if two is not None and _NAMES[1] in two:
        return True
    log.info("the chat template renders one tool call per assistant message: replies carry at most one")
    return False

"""Messages between the OpenAI wire form and the chat template's.

Clients send `function.arguments` as a JSON string (the OpenAI API's type), while the Qwen3.5, Qwen3-Coder
and Llama 3 templates read it as a mapping (`arguments|items`, `arguments|tojson`): `template_message`
parses it, as vLLM does, and keeps a string that is not a JSON object as it is (the template then decides).
Reasoning sent back under either name (`reasoning_content`, vLLM's `reasoning`) reaches the template as
`reasoning_content`. `assistant_message` is the inverse: a parsed reply in the form a client sends it back.
"""

from __future__ import annotations

import json

from .reply import ParsedReply


def content_text(content) -> str:
    """A message's content as text: a string, text parts joined, or "" for none."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)


def template_arguments(arguments):
    """`function.arguments` for a template: a JSON object string becomes the mapping it encodes."""
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except (ValueError, RecursionError):  # (a client's string nested past the parser's depth)
            return arguments
        return parsed if isinstance(parsed, dict) else arguments
    return arguments


def template_message(message: dict) -> dict:
    """A wire message (a dict, None fields left out or None) as the chat template reads it. The legacy
    forms (an assistant's `function_call`, a `function` message) are read as a tool call and a tool message."""
    role = message["role"]
    if role == "function":
        message, role = {**message, "role": "tool"}, "tool"
    if role == "assistant" and message.get("function_call") and not message.get("tool_calls"):
        message = {**message, "tool_calls": [{"type": "function", "function": message["function_call"]}]}
    out = {"role": role, "content": content_text(message.get("content"))}
    if role == "assistant":
        reasoning = message.get("reasoning_content")
        if not isinstance(reasoning, str):
            reasoning = message.get("reasoning")
        if isinstance(reasoning, str):
            out["reasoning_content"] = reasoning
        calls = message.get("tool_calls") or []
        if calls:
            out["tool_calls"] = [
                {
                    "id": c.get("id") or "",
                    "type": c.get("type") or "function",
                    "function": {
                        "name": c["function"]["name"],
                        "arguments": template_arguments(c["function"].get("arguments", {})),
                    },
                }
                for c in calls
            ]
    elif role == "tool":
        for key in ("tool_call_id", "name"):
            if isinstance(message.get(key), str):
                out[key] = message[key]
    return out


def assistant_message(reply: ParsedReply) -> dict:
    """The reply as an OpenAI assistant message: what a client appends to its history for the next turn."""
    out: dict = {"role": "assistant", "content": reply.content}
    if reply.reasoning is not None:
        out["reasoning_content"] = reply.reasoning
    if reply.tool_calls:
        out["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in reply.tool_calls
        ]
    return out


def reasoning_of(message: dict) -> str:
    """The reasoning an assistant message carries (either name, or a `<think>` block left in its content)."""
    for key in ("reasoning_content", "reasoning"):
        if isinstance(message.get(key), str) and message[key].strip():
            return message[key]
    content = content_text(message.get("content"))
    return content.split("</think>")[0] if "</think>" in content else ""


def without_reasoning(message: dict) -> dict:
    """An assistant message as a client that does not send reasoning back returns it."""
    return {k: v for k, v in message.items() if k not in ("reasoning_content", "reasoning")}


def sends_reasoning(messages: list[dict]) -> bool:
    """Whether this conversation's client is seen to send the model's reasoning back: an earlier assistant
    message carries some. False also where it cannot be told (no earlier reply, or replies without reasoning:
    a client that drops it looks like a model that wrote none)."""
    return any(m.get("role") == "assistant" and bool(reasoning_of(m)) for m in messages)

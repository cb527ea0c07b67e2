"""Reading fixed model outputs through the same reader the server streams with, chunked every way."""

from __future__ import annotations

import json

from hyserve.chat import CallEvent, ChatTurn, TextEvent, read_reply
from hyserve.parsers import Parsers

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "metric": {"type": "boolean"},
                    "ratio": {"type": "number"},
                    "tags": {"type": "array"},
                    "opts": {"type": "object"},
                    "note": {"type": ["string", "null"]},
                },
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {"name": "run_code", "parameters": {"type": "object", "properties": {"code": {"type": "string"}}}},
    },
]


def turn(tool=None, reasoning=None, opened=False, **kw) -> ChatTurn:
    t = ChatTurn(Parsers(tool, reasoning), tools=kw.pop("tools", TOOLS), **kw)
    t.reasoning_opened = opened
    return t


def stream(t: ChatTurn, chunks) -> list:
    """Events of one reply fed in `chunks`, consecutive texts of a channel joined, call ids left out."""
    reader = t.reader()
    events = []
    for c in chunks:
        events += reader.feed(c)
    events += reader.finish()
    out = []
    for ev in events:
        if isinstance(ev, TextEvent):
            assert ev.text, "no empty text events"
            if out and out[-1][0] == ev.channel:
                out[-1] = (ev.channel, out[-1][1] + ev.text)
            else:
                out.append((ev.channel, ev.text))
        else:
            assert isinstance(ev, CallEvent) and ev.call.id.startswith("call_")
            out.append(("call", ev.index, ev.call.name, json.loads(ev.call.arguments)))
    return out


def check_every_split(t: ChatTurn, text: str) -> list:
    """The events of `text` whole; asserts that every two-piece split and char-by-char feeding give the
    same, and that they agree with the unstreamed `read_reply`."""
    whole = stream(t, [text])
    for i in range(1, len(text)):
        assert stream(t, [text[:i], text[i:]]) == whole, (i, text[:i], text[i:])
    assert stream(t, list(text)) == whole
    reply = read_reply(text, t.reader())
    content = "".join(e[1] for e in whole if e[0] == "content")
    reasoning = "".join(e[1] for e in whole if e[0] == "reasoning")
    assert reply.content == (content if content or not reply.tool_calls else None)
    assert reply.reasoning == (reasoning or None)
    assert [(c.name, json.loads(c.arguments)) for c in reply.tool_calls] == [e[2:] for e in whole if e[0] == "call"]
    return whole


def parsed(t: ChatTurn, text: str):
    """(content, reasoning, [(name, arguments)]) of `text`, after checking every split."""
    check_every_split(t, text)
    reply = read_reply(text, t.reader())
    return reply.content, reply.reasoning, [(c.name, json.loads(c.arguments)) for c in reply.tool_calls]

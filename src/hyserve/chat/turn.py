"""One chat request's tools, template options and reply reading.

The request's `tools` and `chat_template_kwargs` go to every render of its messages (prompt, history
boundary, re-render after the reply: `template_kwargs`), or the boundaries stop being prefixes of the
prompt. Tool calls are parsed only when the request has tools and `tool_choice` is not "none"; "required"
and a named function are validated and passed to the template, not enforced by constrained decoding.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

from ..parsers.base import ToolSchemas
from ..parsers.registry import Parsers
from .messages import assistant_message, template_message
from .reply import ParsedReply, ReplyReader, read_reply


class ChatRequestError(ValueError):
    """A request's tool or template options are inconsistent: a 400 for `param`."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def _reserved_template_args() -> frozenset[str]:
    """Arguments of `apply_chat_template` itself: `chat_template_kwargs` may not set them (a `chat_template`
    there would swap the template, `tools` would bypass validation)."""
    from transformers import PreTrainedTokenizerBase

    params = inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters
    return frozenset(p for p in params if p not in ("self", "kwargs")) | {"messages", "conversation", "tools"}


_RESERVED: frozenset[str] | None = None
PROMPT_TAIL_TOKENS = 8  # enough of the prompt's end to see whether its generation prompt opens `<think>`


@dataclass
class ChatTurn:
    parsers: Parsers
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None  # "none" | "auto" | "required" | {"type": "function", ...}
    parallel_tool_calls: bool = True
    template_options: dict = field(default_factory=dict)  # the request's chat_template_kwargs
    reasoning_opened: bool = False  # the prompt ends inside a `<think>` block
    _parsed: tuple[str, ParsedReply] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        global _RESERVED
        if _RESERVED is None:
            _RESERVED = _reserved_template_args()
        bad = sorted(k for k in self.template_options if k in _RESERVED)
        if bad:
            raise ChatRequestError(f"chat_template_kwargs may not set {', '.join(bad)}", "chat_template_kwargs")
        names = [t["function"]["name"] for t in self.tools or []]
        choice = self.tool_choice
        if choice is not None and choice not in ("none", "auto") and not names:
            raise ChatRequestError("tool_choice is only allowed when tools are specified", "tool_choice")
        if isinstance(choice, dict) and choice["function"]["name"] not in names:
            raise ChatRequestError(
                f"tool_choice names the function {choice['function']['name']!r}, which is not "
                f"among the request's tools",
                "tool_choice",
            )

    @property
    def template_kwargs(self) -> dict:
        """Extra arguments of every chat-template render of this request."""
        return {**self.template_options, **({"tools": self.tools} if self.tools else {})}

    @property
    def parses_tool_calls(self) -> bool:
        return bool(self.parsers.tool and self.tools and self.tool_choice != "none")

    def note_prompt(self, tokenizer, prompt: list[int]) -> None:
        """Read from the rendered prompt whether the reply starts inside a reasoning block."""
        if self.parsers.reasoning is not None:
            tail = tokenizer.decode(list(prompt[-PROMPT_TAIL_TOKENS:]), skip_special_tokens=False)
            self.reasoning_opened = self.parsers.reasoning.opened_by(tail)

    def reader(self) -> ReplyReader:
        """A fresh reader for this request's reply (the streaming path and `parse` both use one). On a template
        that renders one tool call per assistant message (Llama 3.x) the reply carries only the first call,
        even with `parallel_tool_calls`: a reply with two would be a history the next request cannot send."""
        reasoning = self.parsers.reasoning(self.reasoning_opened) if self.parsers.reasoning else None
        tools = self.parsers.tool(ToolSchemas.of(self.tools)) if self.parses_tool_calls else None
        return ReplyReader(reasoning, tools, self.parallel_tool_calls and not self.parsers.single_tool_call)

    def parse(self, text: str) -> ParsedReply:
        """The whole reply read (the last one kept, so every caller sees the same call ids)."""
        parsed = self._parsed  # one read: n > 1 choices parse on the engine's and the HTTP threads
        if parsed is None or parsed[0] != text:
            parsed = self._parsed = (text, read_reply(text, self.reader()))
        return parsed[1]

    def assistant_message(self, text: str) -> dict:
        """The reply as the client sends it back next turn (OpenAI form: arguments as JSON strings)."""
        return assistant_message(self.parse(text))

    def history_message(self, text: str) -> dict:
        """The reply as the next request's `messages` will hold it once rendered (`template_message` form).
        The engine calls it for the post-decode checkpoint, which must never fail a request: on any error,
        the text as content."""
        try:
            return template_message(self.assistant_message(text))
        except Exception:
            return {"role": "assistant", "content": text}

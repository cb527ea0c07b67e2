"""The chat layer between the HTTP schemas and the engine: messages in the template's form, a request's
tools and template options (`ChatTurn`), and the reply read back into reasoning, answer and tool calls."""

from .messages import assistant_message, template_message
from .reply import CallEvent, ParsedReply, ReplyReader, TextEvent, read_reply
from .turn import ChatRequestError, ChatTurn

__all__ = [
    "CallEvent",
    "ChatRequestError",
    "ChatTurn",
    "ParsedReply",
    "ReplyReader",
    "TextEvent",
    "assistant_message",
    "read_reply",
    "template_message",
]

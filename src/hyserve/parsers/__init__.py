"""Reading a model's reply: reasoning and tool calls out of its text, one module per format, and the
registry that picks the formats from the chat template (overridable by `--tool-call-parser` /
`--reasoning-parser`)."""

from .base import ToolCall, ToolParser, ToolSchemas
from .registry import REASONING_PARSERS, TOOL_PARSERS, Parsers, choose_parsers

__all__ = ["REASONING_PARSERS", "TOOL_PARSERS", "Parsers", "ToolCall", "ToolParser", "ToolSchemas", "choose_parsers"]

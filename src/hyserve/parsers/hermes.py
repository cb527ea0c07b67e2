"""Hermes / Qwen3 / Granite tool calls: a JSON object `{"name": ..., "arguments": {...}}` inside
`<tool_call>…</tool_call>`, one block per call. A last block the reply ends inside (no closing tag) still
counts when its JSON is whole, as in vLLM's hermes parser."""

from __future__ import annotations

import json

from .base import TaggedBlocks, ToolCall, arguments_json, valid_name


class HermesParser(TaggedBlocks):
    name = "hermes"

    def parse_block(self, body: str, closed: bool) -> list[ToolCall] | None:
        obj = json.loads(body.strip())
        if not isinstance(obj, dict) or not valid_name(obj.get("name")):
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        args_json = arguments_json(args)
        if args_json is None:
            return None
        return [ToolCall(obj["name"], args_json)]

    @classmethod
    def detects(cls, template: str) -> bool:
        return super().detects(template) and "<function=" not in template

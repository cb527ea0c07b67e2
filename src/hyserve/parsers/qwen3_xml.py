"""Qwen3.5 / Qwen3-Coder tool calls, XML in a `<tool_call>` block:

    <tool_call>
    <function=NAME>
    <parameter=P>
    value
    </parameter>
    </function>
    </tool_call>

Parameter values are text; each is typed by its tool's whole JSON schema for it (`$ref`s, `anyOf`, nested
objects: `schema_values`), and kept as a string when it has no schema or does not convert.
A missing `</parameter>` ends at the next parameter or at `</function>`, as models sometimes write it."""

from __future__ import annotations

import json
import re

from .base import TaggedBlocks, ToolCall, valid_name
from .schema_values import typed_value as convert

_FUNCTION = re.compile(r"<function=([^>\n]*)>(.*?)</function>", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\n]*)>(.*?)(?:</parameter>|(?=<parameter=)|\Z)", re.S)


class Qwen3XmlParser(TaggedBlocks):
    name = "qwen3_xml"

    def parse_block(self, body: str, closed: bool) -> list[ToolCall] | None:
        calls, rest = [], body
        for m in _FUNCTION.finditer(body):
            name = m.group(1).strip()
            if not valid_name(name):
                return None
            schema, root = self.schemas.params.get(name, {}), self.schemas.roots.get(name)
            args = {}
            inner = m.group(2)
            for p in _PARAMETER.finditer(inner):
                key = p.group(1).strip()
                if not key:
                    return None
                args[key] = convert(_strip_newline(p.group(2)), schema.get(key), root)
            if _PARAMETER.sub("", inner).strip():  # text outside any parameter: not this format
                return None
            calls.append(ToolCall(name, json.dumps(args, ensure_ascii=False)))
            rest = rest.replace(m.group(0), "", 1)
        if not calls or rest.strip():
            return None
        return calls

    @classmethod
    def detects(cls, template: str) -> bool:
        return super().detects(template) and "<function=" in template and "<parameter=" in template


def _strip_newline(value: str) -> str:
    """The template writes a value between newlines: drop one on each side, keep the value's own."""
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    return value

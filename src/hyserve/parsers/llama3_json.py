"""Llama 3.x tool calls: the whole reply is a JSON object `{"name": ..., "parameters": {...}}` (several
separated by `;`), optionally after `<|python_tag|>` (a special token, so usually already dropped from the
text). A reply that starts like one is held to its end, then parsed as a whole: all calls, or content."""

from __future__ import annotations

import json

from .base import ToolCall, ToolParser, arguments_json, valid_name

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonParser(ToolParser):
    name = "llama3_json"

    def __init__(self, schemas=None):
        super().__init__(schemas)
        self._buf = ""
        self._mode = "undecided"  # "content": pass through; "json": hold to the end

    def feed(self, text: str) -> list:
        if self._mode == "content":
            return [text] if text else []
        self._buf += text
        if self._mode == "undecided":
            head = self._buf.lstrip()
            if head.startswith("{") or head.startswith(PYTHON_TAG):
                self._mode = "json"
            elif not head or PYTHON_TAG.startswith(head):
                return []
            else:
                self._mode = "content"
                out, self._buf = self._buf, ""
                return [out]
        return []

    def finish(self) -> list:
        buf, self._buf = self._buf, ""
        if not buf:
            return []
        calls = self._parse(buf) if self._mode == "json" else None
        return calls if calls else [buf]

    @staticmethod
    def _parse(text: str) -> list[ToolCall] | None:
        text = text.strip()
        if text.startswith(PYTHON_TAG):
            text = text[len(PYTHON_TAG) :].lstrip()
        decoder, calls, at = json.JSONDecoder(), [], 0
        while True:
            try:
                obj, at = decoder.raw_decode(text, at)
            except (ValueError, RecursionError):
                return None
            if not isinstance(obj, dict) or not valid_name(obj.get("name")):
                return None
            args = arguments_json(obj.get("parameters", obj.get("arguments", {})))
            if args is None:
                return None
            calls.append(ToolCall(obj["name"], args))
            rest = text[at:].lstrip()
            if not rest:
                return calls
            if not rest.startswith(";"):
                return None
            text, at = rest[1:].lstrip(), 0

    @classmethod
    def detects(cls, template: str) -> bool:
        return "<|start_header_id|>" in template and '"parameters": ' in template

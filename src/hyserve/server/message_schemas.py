"""Anthropic's Messages request body and its content blocks as chat messages (the chat machinery does the
rest): `system` first, `text` blocks as content, `thinking` as the assistant's reasoning, `tool_use` as its
tool calls (`input` as JSON arguments), each `tool_result` as a tool message. Tools carry `input_schema`."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from .errors import APIError
from .schemas import SamplingFields, stop_list


class AnthropicMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class AnthropicTool(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str | None = None
    name: str = Field(pattern=r"^[A-Za-z0-9_.:-]{1,128}$")
    description: str | None = None
    input_schema: dict[str, Any] | None = None


class AnthropicToolChoice(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class MessagesRequest(SamplingFields):
    max_tokens: int = Field(gt=0)
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    stop_sequences: list[str] | None = None
    thinking: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM extension, as in chat completions
    n: int = Field(default=1, ge=1, le=1)  # one message per request

    @field_validator("stop_sequences")
    @classmethod
    def _stop_sequences(cls, v):
        return None if v is None else stop_list(v)  # checked as chat's `stop`, errors naming stop_sequences

    @model_validator(mode="after")
    def _stops(self):
        if self.stop_sequences is not None:
            self.stop = self.stop_sequences
        return self

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def logprobs_wanted(self) -> int | None:
        return None  # not offered on this endpoint

    def chat_tools(self) -> list[dict] | None:
        out = []
        for i, t in enumerate(self.tools or []):
            if t.type not in (None, "custom"):
                raise APIError(400, f"tools.{i}: only custom tools are supported, not {t.type!r}", param=f"tools.{i}")
            fn = {"name": t.name, "description": t.description, "parameters": t.input_schema}
            out.append({"type": "function", "function": {k: v for k, v in fn.items() if v is not None}})
        return out or None

    def chat_tool_choice(self):
        c = self.tool_choice
        if c is None:
            return None
        if c.type == "tool":
            if not c.name:
                raise APIError(400, "tool_choice.name: required when type is 'tool'", param="tool_choice.name")
            return {"type": "function", "function": {"name": c.name}}
        return {"auto": "auto", "any": "required", "none": "none"}[c.type]

    def template_options(self) -> dict:
        """`chat_template_kwargs`, with `thinking` as `enable_thinking`."""
        out = dict(self.chat_template_kwargs or {})
        if self.thinking and self.thinking.get("type") in ("enabled", "disabled"):
            out.setdefault("enable_thinking", self.thinking["type"] == "enabled")
        return out


def _text(content, param: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{param}: must be a string or a list of text blocks", param=param)
    parts = []
    for j, block in enumerate(content):
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            raise APIError(400, f"{param}.{j}: only text blocks are supported here", param=f"{param}.{j}")
        parts.append(block["text"])
    return "".join(parts)


def _unsupported(kind) -> str:
    if kind in ("image", "document"):
        return f"this server is text-only: {kind!r} blocks are not supported"
    return f"unsupported content block {kind!r} (text and tool_result only)"


def chat_messages(body: MessagesRequest) -> list[dict]:
    """The request's system prompt and messages as chat-completions wire messages."""
    out: list[dict] = []
    if body.system:
        out.append({"role": "system", "content": _text(body.system, "system")})
    for i, m in enumerate(body.messages):
        param = f"messages.{i}.content"
        blocks = [{"type": "text", "text": m.content}] if isinstance(m.content, str) else m.content
        if m.role == "assistant":
            out.append(_assistant(blocks, param))
            continue
        text: list[str] = []
        for j, b in enumerate(blocks):
            kind = b.get("type") if isinstance(b, dict) else None
            if kind == "text" and isinstance(b.get("text"), str):
                text.append(b["text"])
            elif kind == "tool_result" and isinstance(b.get("tool_use_id"), str):
                result = _text(b.get("content", ""), f"{param}.{j}.content")
                if b.get("is_error"):
                    result = f"Error: {result}"
                out.append({"role": "tool", "tool_call_id": b["tool_use_id"], "content": result})
            else:
                raise APIError(400, f"{param}.{j}: {_unsupported(kind)}", param=f"{param}.{j}")
        if text or not blocks:
            out.append({"role": "user", "content": "".join(text)})
    return out


def _assistant(blocks: list, param: str) -> dict:
    msg: dict = {"role": "assistant", "content": ""}
    for j, b in enumerate(blocks):
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text" and isinstance(b.get("text"), str):
            msg["content"] += b["text"]
        elif kind == "thinking" and isinstance(b.get("thinking"), str):
            msg["reasoning_content"] = msg.get("reasoning_content", "") + b["thinking"]
        elif kind == "redacted_thinking":
            continue
        elif kind == "tool_use" and isinstance(b.get("id"), str) and isinstance(b.get("name"), str):
            msg.setdefault("tool_calls", []).append(
                {
                    "id": b["id"],
                    "type": "function",
                    "function": {"name": b["name"], "arguments": json.dumps(b.get("input") or {}, ensure_ascii=False)},
                }
            )
        else:
            raise APIError(400, f"{param}.{j}: unsupported assistant content block {kind!r}", param=f"{param}.{j}")
    return msg


class CountTokensRequest(MessagesRequest):
    max_tokens: int = Field(default=1, gt=0)  # not part of a count request

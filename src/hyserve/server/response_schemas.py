"""The Responses API's request body and its input items as chat messages (the chat machinery does the rest).

Input items: messages (`input_text` / `output_text` parts), `function_call` (an assistant tool call),
`function_call_output` (a tool message) and `reasoning` (the next assistant message's reasoning). Function
tools are flat here (`{"type": "function", "name", ...}`) and nested in chat (`{"function": {...}}`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ..engine.grammar import Spec
from .errors import APIError
from .schemas import Effort, SamplingFields, thinking_options
from .structured import format_spec


class ResponseTool(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    name: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_.:-]{1,128}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponseToolChoice(BaseModel):
    type: Literal["function"]
    name: str


class ReasoningOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    effort: Effort | None = None
    summary: str | None = None


class TextFormat(BaseModel):
    """`text.format`: Responses' flat form of chat's `response_format` (`name`, `schema` beside `type`)."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    format: TextFormat | None = None


class ResponsesRequest(SamplingFields):
    input: str | list[dict[str, Any]] = Field(min_length=1)
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, gt=0)
    tools: list[ResponseTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ResponseToolChoice | None = None
    parallel_tool_calls: bool = True
    reasoning: ReasoningOptions | None = None
    text: TextOptions | None = None
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM extension, as in chat completions
    n: int = Field(default=1, ge=1, le=1)  # one output per response

    def requested_max_tokens(self) -> int | None:
        return self.max_output_tokens

    def max_tokens_param(self) -> str:
        return "max_output_tokens"

    def logprobs_wanted(self) -> int | None:
        return None  # not offered on this endpoint

    def chat_tools(self) -> list[dict] | None:
        """Function tools in chat form; any other tool type is refused (hyserve runs no hosted tools)."""
        out = []
        for i, t in enumerate(self.tools or []):
            if t.type != "function" or not t.name:
                raise APIError(
                    400, f"only function tools are supported (tools[{i}] is {t.type!r})", param=f"tools[{i}]"
                )
            fn = {"name": t.name, "description": t.description, "parameters": t.parameters, "strict": t.strict}
            out.append({"type": "function", "function": {k: v for k, v in fn.items() if v is not None}})
        return out or None

    def chat_tool_choice(self):
        c = self.tool_choice
        return c if isinstance(c, (str, type(None))) else {"type": "function", "function": {"name": c.name}}

    def template_options(self) -> dict:
        """`chat_template_kwargs`, with `reasoning.effort: "none"` as `enable_thinking: false`."""
        return thinking_options(self.chat_template_kwargs, self.reasoning.effort if self.reasoning else None)

    def format_specs(self) -> list[Spec]:
        f = self.text.format if self.text is not None else None
        own = format_spec(f.type, f.schema_, "text.format", "text.format") if f is not None else []
        return super().format_specs() + own

    def text_options(self) -> dict:
        """`text` as the response reports it: the format in force."""
        f = self.text.format if self.text is not None else None
        return {"format": f.model_dump(by_alias=True, exclude_none=True) if f is not None else {"type": "text"}}


def _text(content, param: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, "content must be a string or a list of parts", param=param)
    out = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text", "reasoning_text", "summary_text"):
            raise APIError(
                400, f"this server is text-only: content part type {kind!r} is not supported", param=f"{param}[{j}]"
            )
        if not isinstance(part.get("text"), str):
            raise APIError(400, "a text part needs a string `text`", param=f"{param}[{j}].text")
        out.append(part["text"])
    return "".join(out)


def _field(item: dict, key: str, param: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise APIError(400, f"missing required parameter: {param}.{key}", param=f"{param}.{key}")
    return value


def input_messages(body: ResponsesRequest) -> list[dict]:
    """The request's instructions and input items as chat-completions wire messages."""
    out: list[dict] = []
    if body.instructions and body.previous_response_id is None:
        out.append({"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        return out + [{"role": "user", "content": body.input}]
    reasoning: str | None = None
    for i, item in enumerate(body.input):
        param = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise APIError(400, f"invalid role {role!r}", param=f"{param}.role")
            msg = {"role": role, "content": _text(item.get("content"), f"{param}.content")}
            if role == "assistant" and reasoning is not None:
                msg["reasoning_content"], reasoning = reasoning, None
            out.append(msg)
        elif kind == "function_call":
            call = {
                "id": _field(item, "call_id", param),
                "type": "function",
                "function": {"name": _field(item, "name", param), "arguments": _field(item, "arguments", param)},
            }
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and (last.get("tool_calls") or not last["content"]):
                last.setdefault("tool_calls", []).append(call)  # one assistant turn: its text, then its calls
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
                if reasoning is not None:
                    out[-1]["reasoning_content"], reasoning = reasoning, None
        elif kind == "function_call_output":
            output = item.get("output")
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": _field(item, "call_id", param),
                    "content": _text(output, f"{param}.output"),
                }
            )
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            reasoning = _text(parts, f"{param}.content")
        else:
            raise APIError(400, f"unsupported input item type {kind!r}", param=f"{param}.type")
    return out

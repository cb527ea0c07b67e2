"""OpenAI request bodies as pydantic models: validation errors become 400s with the offending param."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from .structured import StructuredFields

MAX_STOP_STRINGS = 4
GREEDY_BELOW = 1e-5  # a lower temperature is greedy decoding (as in vLLM): 1/T would overflow the logits
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed accepts
MAX_TOP_K = 2**31 - 1
# A lower repetition penalty divides logits by up to 1/0.01: with 1/T for T >= GREEDY_BELOW the row stays finite
# (a float32 logit under 3e31), while 1e-38 overflows it to inf and the softmax to NaN.
MIN_REPETITION_PENALTY = 0.01
TOKEN_ID = re.compile(r"\s*-?[0-9]+\s*")  # a logit_bias key: ASCII digits, as `int` then reads it
MAX_LOGPROBS = 20
MAX_N = 16
Effort = Literal["none", "minimal", "low", "medium", "high", "xhigh"]


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["text"]
    text: str


class ToolCallFunction(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = Field(min_length=1)
    arguments: str | dict[str, Any] = "{}"  # the API's type is a JSON string; a mapping is accepted too


class MessageToolCall(BaseModel):
    model_config = ConfigDict(extra="allow")
    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


def text_only(content):
    """A content part that is not text is refused by name (this server is text-only), not as a union's
    mismatch ("should be a valid string"); the handler reports it as `messages[i].content[j]`."""
    if isinstance(content, list):
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                raise PydanticCustomError(
                    "text_only",
                    "this server is text-only: content part type {kind} is not supported (only text parts are)",
                    {"kind": repr(kind), "part": j},
                )
    return content


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]  # function: the legacy tool
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # assistant messages
    function_call: ToolCallFunction | None = None  # assistant messages: the legacy (deprecated) form of a call
    tool_call_id: str | None = None  # tool messages
    reasoning_content: str | None = None  # assistant messages: reasoning sent back (also as vLLM's `reasoning`)
    reasoning: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, v):
        return text_only(v)


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = Field(pattern=r"^[A-Za-z0-9_.:-]{1,128}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


class StreamOptions(BaseModel):
    include_usage: bool = False


def stop_list(v) -> list[str]:
    """Stop strings as a list, checked (chat's `stop`, Anthropic's `stop_sequences`)."""
    if v is None:
        return []
    stops = [v] if isinstance(v, str) else v
    if len(stops) > MAX_STOP_STRINGS:
        raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
    if any(not s for s in stops):
        raise ValueError("stop strings must be non-empty")
    return stops


class SamplingFields(StructuredFields):
    """Fields shared by chat and text completions (the structured-output ones in `structured`)."""

    model_config = ConfigDict(extra="allow")  # like vLLM: unknown OpenAI fields are ignored, not fatal
    model: str
    max_tokens: int | None = Field(default=None, gt=0)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int = Field(default=0, ge=-1, le=MAX_TOP_K)  # 0 or -1: off
    seed: int | None = Field(default=None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    stop: str | list[str] | None = Field(default=None, validate_default=True)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)  # choices, sharing one prefill
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in [-100, 100]
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    repetition_penalty: float = Field(
        default=1.0, ge=MIN_REPETITION_PENALTY, le=10.0, allow_inf_nan=False
    )  # vLLM extension
    min_tokens: int = Field(default=0, ge=0)  # vLLM extension
    stop_token_ids: list[int] | None = None  # vLLM extension
    return_token_ids: bool = False  # vLLM extension: generated token ids in each choice / chunk
    cache_salt: str | None = Field(default=None, max_length=256)  # vLLM extension: prefix-cache namespace

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, v: float) -> float:
        return 0.0 if v < GREEDY_BELOW else v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        return stop_list(v)

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v):
        """Keys must be token ids, read here with the rule that checks them (`str.isdigit` passes "²", which
        `int` refuses) and returned in canonical form; the vocabulary bound is checked by the route."""
        if not v:
            return None
        out: dict[str, float] = {}
        for key, bias in v.items():
            if not TOKEN_ID.fullmatch(key):
                raise ValueError(f"key {key!r} is not a token id")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"bias {bias} for token {key} is outside [-100, 100]")
            if str(int(key)) in out:
                raise ValueError(f"token {int(key)} is given twice")
            out[str(int(key))] = bias
        return out

    def max_tokens_param(self) -> str:
        """The field the request's token budget came from, as errors name it."""
        return "max_tokens"

    def choice_param(self, param: str) -> str:
        """A tool-choice error's field as the request named it."""
        return param

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


def thinking_options(template_kwargs: dict | None, effort: str | None) -> dict:
    """`chat_template_kwargs`, with a reasoning effort of "none" as the templates' thinking switch
    (`enable_thinking: false`, read by the Qwen3 and Qwen3.5 templates); an explicit switch wins."""
    out = dict(template_kwargs or {})
    if effort == "none":
        out.setdefault("enable_thinking", False)
    return out


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, gt=0)
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    functions: list[FunctionDefinition] | None = Field(default=None, min_length=1)  # deprecated `tools`
    function_call: Literal["none", "auto"] | NamedFunction | None = None  # deprecated `tool_choice`
    parallel_tool_calls: bool = True
    reasoning_effort: Effort | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM extension: extra chat-template variables
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    @model_validator(mode="after")
    def _one_tool_form(self):
        if self.functions is not None and self.tools is not None:
            raise PydanticCustomError("legacy_mix", "set tools or the deprecated functions, not both")
        if self.function_call is not None and self.tool_choice is not None:
            raise PydanticCustomError("legacy_mix", "set tool_choice or the deprecated function_call, not both")
        return self

    @property
    def legacy_functions(self) -> bool:
        """`functions` was sent: the reply then carries OpenAI's legacy `function_call` (one call)."""
        return self.functions is not None

    def chat_tools(self) -> list[dict] | None:
        """`tools`, or the legacy `functions` as tools (as vLLM and OpenAI map them)."""
        if self.functions is not None:
            return [{"type": "function", "function": f.model_dump(exclude_none=True)} for f in self.functions]
        return [t.model_dump(exclude_none=True) for t in self.tools or []] or None

    def chat_tool_choice(self):
        c = self.tool_choice if self.function_call is None else self.function_call
        if isinstance(c, NamedFunction):
            return {"type": "function", "function": {"name": c.name}}
        return c if isinstance(c, (str, type(None))) else c.model_dump()

    def choice_param(self, param: str) -> str:
        """A tool-choice error's field as the request named it."""
        return "function_call" if param == "tool_choice" and self.function_call is not None else param

    def template_options(self) -> dict:
        return thinking_options(self.chat_template_kwargs, self.reasoning_effort)

    def logprobs_wanted(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def max_tokens_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens else "max_tokens"


class CompletionRequest(SamplingFields):
    prompt: str | list[int]
    max_tokens: int | None = Field(default=16, gt=0)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False

    def logprobs_wanted(self) -> int | None:
        return self.logprobs

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        if isinstance(v, str) and not v:
            raise ValueError("prompt must not be empty")
        if isinstance(v, list) and not v:
            raise ValueError("prompt must not be empty")
        return v

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a raw `prompt`, or chat `messages` rendered as /v1/chat/completions renders them."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_generation_prompt: bool = True  # chat only
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages (as vLLM)
    return_token_strs: bool = False
    tools: list[ToolDefinition] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    tokens: list[int]

"""Structured-output fields of a request (OpenAI's `response_format`, vLLM's `structured_outputs` and
`guided_*`) read into one `grammar.Spec`: at most one constraint per request, a clear 400 otherwise."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ..engine.grammar import Spec
from .errors import APIError


class JSONSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` (its `guided_*` fields grouped): set exactly one."""

    model_config = ConfigDict(extra="allow")
    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(default=None, min_length=1)
    grammar: str | None = None
    json_object: bool | None = None


class StructuredFields(BaseModel):
    """Mixed into the request bodies of every generating route."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(default=None, min_length=1)
    guided_grammar: str | None = None

    def format_specs(self) -> list[Spec]:
        """The output-format constraints (OpenAI's `response_format`; Responses adds `text.format`)."""
        rf = self.response_format
        if rf is None:
            return []
        schema = rf.json_schema.schema_ if rf.json_schema is not None else None
        return format_spec(rf.type, schema, "response_format", "response_format.json_schema")


ANY_OBJECT = json.dumps({"type": "object"})


def _schema(value, param: str) -> str:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise APIError(400, f"{param} is not valid JSON: {exc}", param=param) from exc
    if not isinstance(value, (dict, bool)):
        raise APIError(400, f"{param} must be a JSON schema (an object)", param=param)
    return json.dumps(value)


def format_spec(kind: str, schema, param: str, schema_param: str) -> list[Spec]:
    """An output format of type `kind` (text, json_object, json_schema) as its constraint: none for text."""
    if kind == "json_object":
        return [Spec("json", ANY_OBJECT, param)]
    if kind != "json_schema":
        return []
    if schema is None:
        raise APIError(400, f"{param} of type json_schema needs a schema", param=schema_param)
    return [Spec("json", _schema(schema, f"{schema_param}.schema"), f"{schema_param}.schema")]


def constraint_of(body: StructuredFields) -> Spec | None:
    """The request's one constraint, or None. Two at once (say response_format and guided_regex) is a 400."""
    found: list[Spec] = body.format_specs()
    so = body.structured_outputs
    fields = [
        ("guided_json", body.guided_json),
        ("guided_regex", body.guided_regex),
        ("guided_choice", body.guided_choice),
        ("guided_grammar", body.guided_grammar),
    ]
    if so is not None:
        fields += [
            ("structured_outputs.json", so.json_),
            ("structured_outputs.regex", so.regex),
            ("structured_outputs.choice", so.choice),
            ("structured_outputs.grammar", so.grammar),
        ]
        if so.json_object:
            found.append(Spec("json", ANY_OBJECT, "structured_outputs.json_object"))
    for param, value in fields:
        if value is None:
            continue
        kind = param.rsplit(".", 1)[-1].removeprefix("guided_")
        if kind == "json":
            found.append(Spec("json", _schema(value, param), param))
        elif kind == "choice":
            found.append(Spec("choice", json.dumps(value), param))
        else:
            found.append(Spec(kind, value, param))
    if len(found) > 1:
        raise APIError(
            400,
            f"set one structured-output constraint, not {len(found)}: " + ", ".join(s.param for s in found),
            param=found[1].param,
        )
    return found[0] if found else None

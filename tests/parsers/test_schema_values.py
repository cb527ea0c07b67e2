"""XML tool-call parameters typed by the whole JSON Schema pydantic writes for a tool's signature (`anyOf` for
Optional and Union, `$ref` into `$defs` for nested models, `enum`/`const` for Literal): each typed value then
passes pydantic's strict validation, which takes no `"3"` for an int and no JSON text for a model."""

import json
from typing import Literal, Optional, Union

import pytest
from pydantic import BaseModel, TypeAdapter, create_model

from hyserve.parsers.qwen3_xml import Qwen3XmlParser
from hyserve.parsers.schema_values import typed_value

from .helpers import parsed, turn


class Options(BaseModel):
    unit: Literal["C", "F"]
    precision: Optional[int] = None


class Tree(BaseModel):
    value: int
    children: list["Tree"] = []


def typed(annotation, text):
    """`text` typed by the schema pydantic writes for a parameter of type `annotation`, as a tool's parameters
    schema holds it (the nested models' `$defs` at its root)."""
    root = create_model("args", x=(annotation, ...)).model_json_schema()
    return typed_value(text, root["properties"]["x"], root)


def strictly(annotation, value) -> bool:
    try:
        TypeAdapter(annotation).validate_json(json.dumps(value), strict=True)
        return True
    except ValueError:
        return False


@pytest.mark.parametrize(
    "annotation,text,out",
    [
        (Optional[int], "3", 3),
        (Optional[int], "null", None),
        (Optional[int], " 7 ", 7),
        (Optional[float], "2.5", 2.5),
        (Optional[bool], "True", True),
        (Optional[str], "3", "3"),
        (Optional[Options], '{"unit": "C"}', {"unit": "C"}),
        (Optional[Options], '{"unit": "F", "precision": "2"}', {"unit": "F", "precision": 2}),  # typed inside too
        (Options, '{"unit": "C", "precision": null}', {"unit": "C", "precision": None}),
        (
            list[Options],
            '[{"unit": "C"}, {"unit": "F", "precision": 1}]',
            [{"unit": "C"}, {"unit": "F", "precision": 1}],
        ),
        (list[int], '["1", 2]', [1, 2]),
        (dict[str, int], '{"a": "1"}', {"a": 1}),
        (tuple[int, str], '[1, "2"]', [1, "2"]),  # prefixItems: the second stays a string
        (Literal["C", "F"], "C", "C"),
        (Literal["C", "F"], " F\n", "F"),
        (Literal[1, 2], "2", 2),
        (Literal[1, "a"], "1", 1),
        (Literal[1, "a"], "a", "a"),
        (Literal[True], "true", True),
        (Union[int, str], "5", "5"),
        (Union[int, str], "five", "five"),
        (Union[int, list[int]], "[1, 2]", [1, 2]),
        (Union[int, list[int]], "3", 3),
        (Union[Options, int], "4", 4),
        (
            Tree,
            '{"value": "1", "children": [{"value": 2, "children": []}]}',  # recursive: $ref to itself
            {"value": 1, "children": [{"value": 2, "children": []}]},
        ),
    ],
)
def test_pydantic_schemas(annotation, text, out):
    value = typed(annotation, text)
    assert value == out and type(value) is type(out)
    assert strictly(annotation, value)


@pytest.mark.parametrize(
    "annotation,text",
    [
        (Optional[int], "three"),
        (Optional[int], "3.5"),
        (Options, "[1]"),
        (Options, "{not json"),
        (Literal["C", "F"], "K"),
        (list[int], '{"a": 1}'),
    ],
)
def test_nothing_fits_keeps_the_text(annotation, text):
    assert typed(annotation, text) == text


@pytest.mark.parametrize(
    "schema,text,out",
    [
        (
            {"allOf": [{"$ref": "#/definitions/Options"}], "description": "older pydantic"},
            '{"unit": "C"}',
            {"unit": "C"},
        ),
        ({"type": ["integer", "null"]}, "null", None),
        ({"type": "integer", "nullable": True}, "null", None),
        ({"type": "integer", "nullable": True}, "8", 8),
        ({"const": 3}, "3", 3),
        ({"enum": ["3", 3]}, "3", "3"),
        ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "3", 3),
        ({"items": {"type": "integer"}}, '["4"]', [4]),
        ({"properties": {"n": {"type": "integer"}}}, '{"n": 1}', {"n": 1}),  # object and array implied by keywords
        ({"allOf": [{"type": "number"}, {"type": "integer"}]}, "5", 5),
        ({"allOf": [{"type": "string"}, {"type": "integer"}]}, "5", "5"),  # no value is both: the text
        ({"allOf": [{"type": ["integer", "number"]}, {"type": "string"}]}, "5", "5"),
        ({"allOf": [{"type": ["integer", "string"]}, {"type": "number"}]}, "5", 5),
        (
            {"properties": {"zip": {"type": "string"}, "on": {"enum": ["true", "1"]}}},
            '{"zip": 75001, "on": true}',
            {"zip": "75001", "on": "true"},
        ),  # a nested number or boolean where only a string fits: its text
        ({"items": {"type": "string"}}, "[1.5, null]", ["1.5", None]),  # (null has no text to be)
        ({"anyOf": [{"$ref": "#/definitions/A"}, {"$ref": "#/definitions/B"}]}, '{"b": "2"}', {"b": 2}),  # keys fit B
        ({"$ref": "#/definitions/Missing"}, "3", "3"),
        ({"$ref": "https://example.com/s.json"}, "3", "3"),
        ({"$ref": "#"}, "3", "3"),  # refers to itself: no schema in the end
        ({"type": "number"}, "NaN", "NaN"),
        ({"type": "number"}, "Infinity", "Infinity"),
        (False, "3", "3"),
    ],
)
def test_hand_written_schemas(schema, text, out):
    root = {
        "definitions": {
            "Options": Options.model_json_schema(),
            "A": {"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": False},
            "B": {"type": "object", "properties": {"b": {"type": "integer"}}, "additionalProperties": False},
        }
    }
    value = typed_value(text, schema, root if schema != {"$ref": "#"} else schema)
    assert value == out and type(value) is type(out)


def forecast(city: str, days: Optional[int] = None, options: Optional[Options] = None, tags: list[str] = ()):
    """A tool as openai-agents or a pydantic-based client defines it."""


def test_xml_call_typed_by_a_pydantic_signature_whatever_the_chunking():
    params = TypeAdapter(forecast).json_schema()
    tools = [{"type": "function", "function": {"name": "forecast", "parameters": params}}]
    text = (
        "<tool_call>\n<function=forecast>\n<parameter=city>\n3\n</parameter>\n<parameter=days>\n3\n</parameter>\n"
        '<parameter=options>\n{"unit": "C"}\n</parameter>\n<parameter=tags>\n["rain"]\n</parameter>\n'
        "</function>\n</tool_call>"
    )
    args = {"city": "3", "days": 3, "options": {"unit": "C"}, "tags": ["rain"]}
    assert parsed(turn(Qwen3XmlParser, tools=tools), text) == (None, None, [("forecast", args)])


def test_self_branching_refs_are_flattened_once(monkeypatch):
    """`A: anyOf [A, A]` nests 2^depth branches: each schema is flattened once (and the walk is bounded)."""
    from hyserve.parsers import schema_values

    own, seen = schema_values._own, []

    def counted(schema):
        seen.append(schema)
        assert len(seen) < 1000, "flattened again and again"
        return own(schema)

    monkeypatch.setattr(schema_values, "_own", counted)
    root = {"$defs": {"A": {"anyOf": [{"$ref": "#/$defs/A"}, {"$ref": "#/$defs/A"}, {"type": "integer"}]}}}
    assert typed_value("3", {"$ref": "#/$defs/A"}, root) == 3


@pytest.mark.parametrize(
    "schema",
    [
        {"type": [{"x": 1}, "integer"]},
        {"enum": [{"a": [1]}, [2]], "const": None},
        {"allOf": {"type": "integer"}, "anyOf": "x", "items": 3, "properties": []},
        {"prefixItems": [1], "additionalProperties": "no"},
    ],
)
def test_odd_schemas_do_not_fail(schema):
    assert typed_value("3", schema, {}) in ("3", 3)
    assert typed_value('{"a": [1]}', schema, {}) in ('{"a": [1]}', {"a": [1]})

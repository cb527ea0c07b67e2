"""Text typed by a JSON Schema: the Qwen XML tool-call format writes every parameter value as text, and the
client validating the arguments (pydantic, openai-agents' `function_tool`) needs `3`, not `"3"`, where the
schema wants an integer, and the object, not its JSON text, where it wants an object.

The whole schema is read, as pydantic and hand-written tools write it: `$ref` into `$defs` / `definitions`,
`anyOf` / `oneOf` / `allOf`, `type` lists, OpenAPI's `nullable`, `enum` / `const`, and nested `properties`,
`additionalProperties`, `items` and `prefixItems` (a value inside an object or array is typed by its own
schema). A schema is flattened into alternatives, each a set of types and maybe allowed values; the value is
the first reading of the text (the text itself, then its JSON, then a `True`/`false` boolean) that some
alternative takes, preferring one whose nested values all fit. When nothing fits, the text is kept, as it is
when the schema has no types at all; only shapes decide (not `minimum`, `pattern`, `required`: the tool's own
validation reports those with the value the model meant).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

MAX_DEPTH = 32  # `$ref` chains and nesting deeper than this type nothing (recursive or hostile schemas)
MAX_ALTERNATIVES = 64  # `allOf` of `anyOf`s multiplies alternatives: stop at this many
MAX_SCHEMAS = 4096  # schemas flattened for one value; past it, what is left types nothing
_MISSING = object()


@dataclass
class Shape:
    """One alternative of a schema: the value's types (None: any), its allowed values (None: any), and the
    schemas of what it contains."""

    types: frozenset | None = None
    choices: tuple | None = None
    properties: dict = field(default_factory=dict)
    extra: object = None  # additionalProperties: a schema, False, or None (anything)
    items: object = None  # the schema of every array item (after `prefix`)
    prefix: tuple = ()  # the schemas of the first items


def typed_value(text: str, schema, root=None) -> object:
    """`text` as the JSON value `schema` asks for (its `$ref`s resolved in `root`, the tool's whole parameters
    schema); the text itself when nothing fits. A `null` text is None when the schema names null."""
    walk = _Walk(root)
    shapes = walk.flatten(schema)
    if text.strip().lower() == "null" and any(_names_null(s) for s in shapes):
        return None
    return _from_text(text, shapes, walk, 0)[0]


class _Walk:
    """One value's typing: the root `$ref`s resolve in, and each schema flattened once, within a bound (a
    schema whose `$ref`s branch back into themselves would otherwise take exponential time)."""

    def __init__(self, root):
        self.root, self.left = root, MAX_SCHEMAS
        self.memo: dict[int, tuple[dict, list[Shape]]] = {}

    def flatten(self, schema, depth: int = 0) -> list[Shape]:
        """`schema` as alternatives with no `$ref` or combinators left."""
        if not isinstance(schema, dict):
            return [Shape()] if schema is not False else []
        seen = self.memo.get(id(schema))
        if seen is not None and seen[0] is schema:
            return seen[1]
        if depth > MAX_DEPTH or self.left <= 0:  # a cycle with no way out (`A: {$ref: A}`), or too much work
            return []
        self.left -= 1
        parts = [[_own(schema)]]
        if isinstance(schema.get("$ref"), str):
            parts.append(self.flatten(_resolve(schema["$ref"], self.root), depth + 1))
        for branch in _list(schema.get("allOf")):
            parts.append(self.flatten(branch, depth + 1))
        for key in ("anyOf", "oneOf"):  # oneOf as anyOf: only shapes are compared, and several may fit
            if isinstance(schema.get(key), list):
                parts.append([s for branch in schema[key] for s in self.flatten(branch, depth + 1)])
        shapes = parts[0]
        for part in parts[1:]:
            shapes = [m for a in shapes for b in part if (m := _merge(a, b)) is not None][:MAX_ALTERNATIVES]
        self.memo[id(schema)] = (schema, shapes)
        return shapes


def _list(value) -> list:
    return value if isinstance(value, list) else []


def _own(schema: dict) -> Shape:
    """The shape a schema's own keywords give (without `$ref` and combinators)."""
    t = schema.get("type")
    types = (
        frozenset(x for x in ([t] if isinstance(t, str) else t) if isinstance(x, str))
        if isinstance(t, (str, list))
        else None
    )
    if types is None and any(k in schema for k in ("properties", "additionalProperties", "required")):
        types = frozenset(["object"])
    elif types is None and any(k in schema for k in ("items", "prefixItems")):
        types = frozenset(["array"])
    if types is not None and schema.get("nullable") is True:
        types |= {"null"}
    choices = None
    if isinstance(schema.get("enum"), list):
        choices = tuple(schema["enum"])
    if "const" in schema:
        choices = (schema["const"],)
    props = schema.get("properties")
    items, prefix = schema.get("items"), schema.get("prefixItems")
    if isinstance(items, list):  # the older tuple form of `items`
        items, prefix = schema.get("additionalItems"), items
    extra = schema.get("additionalProperties")
    return Shape(
        types,
        choices,
        props if isinstance(props, dict) else {},
        extra if extra is not True else None,
        items if items is not True else None,
        tuple(prefix) if isinstance(prefix, list) else (),
    )


def _resolve(ref: str, root):
    """The schema a local `$ref` (`#/$defs/Name`, `#/definitions/Name`, `#`) points to in `root`; None (any)
    for one that does not resolve."""
    if not ref.startswith("#"):
        return None
    node = root
    for token in [t for t in ref[1:].split("/") if t]:
        token = token.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and token in node:
            node = node[token]
        elif isinstance(node, list) and token.isdigit() and int(token) < len(node):
            node = node[int(token)]
        else:
            return None
    return node


def _merge(a: Shape, b: Shape) -> Shape | None:
    """Both shapes at once (`allOf`, or a `$ref` with keywords beside it); None when no value fits both."""
    if a.types is None or b.types is None:
        types = b.types if a.types is None else a.types
    else:
        types = a.types & b.types
        if "integer" in a.types and "number" in b.types or "number" in a.types and "integer" in b.types:
            types |= {"integer"}  # an integer is a number
        if not types:
            return None
    choices = a.choices if b.choices is None else b.choices
    if a.choices is not None and b.choices is not None:
        choices = tuple(c for c in a.choices if any(_same(c, d) for d in b.choices))
    props = dict(a.properties)
    for k, v in b.properties.items():
        props[k] = {"allOf": [props[k], v]} if k in props else v
    return Shape(types, choices, props, _either(a.extra, b.extra), _either(a.items, b.items), a.prefix or b.prefix)


def _either(a, b):
    return b if a is None else a


def _names_null(s: Shape) -> bool:
    return (s.types is not None and "null" in s.types) or (s.choices is not None and None in s.choices)


def _is(value, t: str) -> bool:
    if t == "null":
        return value is None
    if t == "boolean":
        return isinstance(value, bool)
    if t == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if t == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, {"string": str, "array": list, "object": dict}.get(t, ()))


def _same(a, b) -> bool:
    """JSON equality: `true` is not `1`."""
    return isinstance(a, bool) == isinstance(b, bool) and a == b


def _fits(value, s: Shape) -> bool:
    return (s.types is None or any(_is(value, t) for t in s.types)) and (
        s.choices is None or any(_same(value, c) for c in s.choices)
    )


def _readings(text: str):
    """What a text may mean besides itself: its JSON (finite numbers only), then a boolean in any case."""
    try:
        yield json.loads(text, parse_constant=_no_constant)
    except (ValueError, RecursionError):
        pass
    if text.lower() in ("true", "false"):
        yield text.lower() == "true"


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def _from_text(text: str, shapes: list[Shape], walk: _Walk, depth: int) -> tuple[object, bool]:
    """(A text typed by alternatives: itself if one takes a string, else its first reading one takes; whether
    it wholly fits). The text itself, and False, when nothing does."""
    if any(_fits(text, s) for s in shapes):
        return text, True
    stripped = text.strip()
    if stripped != text and any(_fits(stripped, s) for s in shapes):
        return stripped, True  # an enum value written with spaces around it
    for reading in _readings(stripped):
        value, whole = _shaped(reading, shapes, walk, depth)
        if value is not _MISSING:
            return value, whole
    return text, False


def _shaped(value, shapes: list[Shape], walk: _Walk, depth: int) -> tuple[object, bool]:
    """(`value` with its insides typed by the first alternative it wholly fits, or else by the first it fits
    at the top; whether it wholly fits). (_MISSING, False) when none fits."""
    first = _MISSING
    for s in shapes:
        if _fits(value, s):
            inside, whole = _inside(value, s, walk, depth)
            if whole:
                return inside, True
            if first is _MISSING:
                first = inside
    return first, False


def _inside(value, s: Shape, walk: _Walk, depth: int) -> tuple[object, bool]:
    """An object's or array's members typed by their schemas; whether they all fit."""
    if depth >= MAX_DEPTH or not isinstance(value, (dict, list)):
        return value, True
    whole = True
    out = {} if isinstance(value, dict) else []
    for k, v in value.items() if isinstance(value, dict) else enumerate(value):
        if isinstance(value, dict):
            schema = s.properties.get(k, s.extra)
            whole &= k in s.properties or s.extra is not False
        else:
            schema = s.prefix[k] if k < len(s.prefix) else s.items
        if isinstance(schema, dict):
            v, fit = _member(v, walk.flatten(schema), walk, depth + 1)
            whole &= fit
        if isinstance(out, dict):
            out[k] = v
        else:
            out.append(v)
    return out, whole


def _member(v, shapes: list[Shape], walk: _Walk, depth: int) -> tuple[object, bool]:
    """A value inside an object or array: a string the schema does not take as one is read like a text, and a
    number or boolean where only a string fits becomes its text (as a parameter's own value would stay)."""
    if isinstance(v, str):
        return _from_text(v, shapes, walk, depth)
    value, whole = _shaped(v, shapes, walk, depth)
    if value is _MISSING and isinstance(v, (int, float)) and any(_fits(json.dumps(v), s) for s in shapes):
        return json.dumps(v), True
    return (v, False) if value is _MISSING else (value, whole)

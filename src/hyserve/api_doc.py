"""docs/api.md, rendered from the server's own OpenAPI document (`/openapi.json`), so the field tables are the
schemas the server validates with (tests/test_api_doc.py fails when the committed file drifts).

Regenerate: `python -m hyserve.api_doc > docs/api.md` (serves nothing: builds a tiny random-init model in a
temporary folder, the app on it, and reads the app's document)."""

from __future__ import annotations

import json
import math
import sys
import tempfile

COMMAND = "python -m hyserve.api_doc > docs/api.md"
_REF = "#/components/schemas/"

# What each route is for and what it answers, one line each: the document has the request's fields, not this.
# A route missing here stops the generator, so a new route cannot go undocumented.
ROUTES: dict[str, str] = {
    "POST /v1/chat/completions": "OpenAI Chat Completions, streamed (`stream`) or not. The reply's "
    "`usage.prompt_tokens_details.cached_tokens` counts the prompt tokens restored from the prefix cache.",
    "POST /v1/completions": "OpenAI Completions: `prompt` is raw text (special-token strings in it are control "
    "tokens) or a list of token ids; one prompt per request.",
    "POST /v1/responses": "OpenAI Responses, on the chat machinery: `reasoning`, `message` and `function_call` "
    "output items; with `store`, `previous_response_id` continues from the stored tokens exactly.",
    "GET /v1/responses/{rid}": "A stored response of the caller's own tenant (404 for any other's).",
    "DELETE /v1/responses/{rid}": "Deletes a stored response of the caller's own tenant.",
    "POST /v1/messages": "Anthropic Messages: `thinking`, `text` and `tool_use` blocks; "
    "`usage.cache_read_input_tokens` counts the prompt tokens restored from the prefix cache. The key may "
    "come as `x-api-key`; errors use Anthropic's body.",
    "POST /v1/messages/count_tokens": "The prompt's token count for a Messages body.",
    "POST /tokenize": "vLLM's shape: a `prompt`, or `messages` rendered by the chat template, to `count`, "
    "`max_model_len`, `tokens` (and `token_strs`), counted as the generation routes count `usage.prompt_tokens`.",
    "POST /detokenize": "vLLM's shape: `tokens` to `prompt`.",
    "GET /v1/models": "The served model (`--served-model-name`) and its context length (`max_model_len`).",
    "GET /v1/models/{model}": "The served model by name (404 for any other name).",
    "GET /health": "`ok` once the model is loaded, with `idle` and each kernel `on` or `off: why`; 503 "
    "`draining` after SIGTERM, 503 `degraded` while the engine makes no progress. Open without a key.",
    "GET /metrics": "Prometheus text: requests, tokens, TTFT and inter-token latency, cache hits, misses, "
    "bytes and evictions, decode batches, the kernels, the process. Open without a key.",
    "GET /v1/cache": "Prefix-cache figures (`entries`, `bytes`, `state_bytes`, `kv_bytes`, `budget_bytes`, "
    "`hits`, `lookups`, `hit_rate`, `tiers`) of the caller's tenant, or of everyone for the admin key.",
    "DELETE /v1/cache": "Clears the caller's tenant's cache entries, in memory and on disk (everyone's for the "
    "admin key).",
    "GET /v1/cache/events": "The most recent `limit` cache decisions (checkpoint taken or not and why, hits, "
    "misses, evictions) of the caller's tenant.",
}


def openapi() -> dict:
    """The document of the app as `hyserve serve` builds it, on a tiny model (the routes do not depend on it)."""
    from .server.app import create_app
    from .service import ServiceConfig, build_service
    from .testing.tiny import make_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        service = build_service(ServiceConfig(model_dir=make_tiny_model(f"{tmp}/model"), device="cpu"))
        try:
            return create_app(service).openapi()
        finally:
            service.engine.stop()


def _number(v: float) -> str:
    """Exact below 2^53; beyond, a float's digits would pretend a precision JSON's doubles do not hold."""
    if abs(v) >= 2**53:  # int64 / uint64 bounds, as a double holds them: the nearest power of two
        exponent = round(math.log2(abs(v)))
        return f"~{'-' if v < 0 else ''}2^{exponent}" if 2.0**exponent == abs(v) else f"~{v:.4g}"
    return str(int(v)) if float(v).is_integer() else f"{v:g}"


def _type(s: dict) -> str:
    """A schema as a reader names it: `string`, `array of [ChatMessage](#chatmessage)`, `"auto"`, ..."""
    if "$ref" in s:
        name = s["$ref"].removeprefix(_REF)
        return f"[{name}](#{name.lower()})"
    if "anyOf" in s:
        kinds = [_type(k) for k in s["anyOf"] if k.get("type") != "null"]
        return " or ".join(dict.fromkeys(kinds))
    if "const" in s:
        return f"`{s['const']!r}`".replace("'", '"')
    if "enum" in s:
        return "one of " + ", ".join(f"`{v}`" for v in s["enum"])
    kind = s.get("type", "any")
    if kind == "array":
        return f"array of {_type(s.get('items', {}))}"
    if kind == "object" and isinstance(s.get("additionalProperties"), dict):
        return f"object of {_type(s['additionalProperties'])}"
    return kind


def _bounds(s: dict) -> str:
    """The domain the server checks: ranges, lengths and item counts, from every branch of an anyOf."""
    out = []
    for branch in s.get("anyOf", [s]):
        lo = ("≥", branch["minimum"]) if "minimum" in branch else ("&gt;", branch.get("exclusiveMinimum"))
        hi = ("≤", branch["maximum"]) if "maximum" in branch else ("&lt;", branch.get("exclusiveMaximum"))
        out += [f"{sign} {_number(v)}" for sign, v in (lo, hi) if v is not None]
        out += [
            f"{label} {branch[key]}"
            for key, label in (
                ("minItems", "items ≥"),
                ("maxItems", "items ≤"),
                ("minLength", "length ≥"),
                ("maxLength", "length ≤"),
            )
            if key in branch
        ]
        if "pattern" in branch:
            out.append(f"matches `{branch['pattern']}`")
    return ", ".join(out)


def _default(s: dict) -> str:
    if "default" not in s or s["default"] is None:
        return ""
    v = s["default"]
    return f"`{v}`" if isinstance(v, str) else f"`{json.dumps(v)}`"


def _fields(schema: dict) -> list[str]:
    required = set(schema.get("required", ()))
    rows = ["| field | type | required | default | domain |", "|---|---|---|---|---|"]
    for name, s in schema.get("properties", {}).items():
        rows.append(f"| `{name}` | {_type(s)} | {'yes' if name in required else ''} | {_default(s)} | {_bounds(s)} |")
    if schema.get("additionalProperties") is True:
        rows.append("| other fields | | | | ignored, and named in the `X-Hyserve-Ignored-Fields` header |")
    return rows


def _parameters(params: list[dict]) -> list[str]:
    rows = ["| parameter | in | type | required | default |", "|---|---|---|---|---|"]
    for p in params:
        rows.append(
            f"| `{p['name']}` | {p['in']} | {_type(p['schema'])} | {'yes' if p.get('required') else ''} "
            f"| {_default(p['schema'])} |"
        )
    return rows


def _used(schema: dict, schemas: dict, seen: list[str]) -> None:
    """The component schemas reachable from `schema`, depth first, each once, in order of first use."""
    if isinstance(schema, dict):
        ref = schema.get("$ref", "")
        if ref.startswith(_REF) and ref.removeprefix(_REF) not in seen:
            seen.append(ref.removeprefix(_REF))
            _used(schemas[ref.removeprefix(_REF)], schemas, seen)
        for v in schema.values():
            _used(v, schemas, seen)
    elif isinstance(schema, list):
        for v in schema:
            _used(v, schemas, seen)


def markdown(doc: dict) -> str:
    """One section per route (what it is for, its parameters, its body's fields), then the objects they use."""
    schemas = doc.get("components", {}).get("schemas", {})
    out = [
        "# HTTP API",
        "",
        f"<!-- generated by `{COMMAND}` from the server's OpenAPI document: edit the request schemas in "
        "src/hyserve/server/ or ROUTES in src/hyserve/api_doc.py, not this file -->",
        "",
        f"Every route of `hyserve serve` {doc['info']['version']}, with the fields of its request body as the "
        "server validates them. A running server serves the same document at `GET /openapi.json` (behind "
        "the API key when one is set).",
        "",
        'Errors use OpenAI\'s body, `{"error": {"message", "type", "param", "code"}}` (Anthropic\'s on '
        "`/v1/messages`): 400 for malformed JSON, a missing, wrongly typed or out-of-domain field (`param` names "
        "it), 401 without a valid key, 404 for an unknown model or route, 408 past `--request-timeout`, 413 over "
        "`--max-body-bytes`, 429 when the queue is full, 503 while draining. A field the server does not know "
        "is ignored and named in the `X-Hyserve-Ignored-Fields` response header.",
        "",
    ]
    operations = [(f"{method.upper()} {path}", op) for path, ops in doc["paths"].items() for method, op in ops.items()]
    missing = [name for name, _ in operations if name not in ROUTES]
    if missing:
        raise KeyError(f"routes without a line in hyserve.api_doc.ROUTES: {', '.join(missing)}")
    out += [f"- [`{name}`](#{_anchor(name)})" for name, _ in operations]
    used: list[str] = []
    for name, op in operations:
        out += ["", f"## {name}", "", ROUTES[name]]
        if op.get("parameters"):
            out += [""] + _parameters(op["parameters"])
        body = op.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema")
        if body:
            ref = body.get("$ref", "").removeprefix(_REF)
            out += ["", "The JSON body:", ""] + _fields(schemas.get(ref, body))
            _used(schemas.get(ref, body), schemas, used)
    out += ["", "## Objects", "", "The objects the request bodies above are made of."]
    for name in used:
        out += ["", f"### {name}", ""] + _fields(schemas[name])
    return "\n".join(out) + "\n"


def _anchor(heading: str) -> str:
    """GitHub's id for a heading: lower case, punctuation other than - and _ dropped, spaces as dashes."""
    return "".join(c for c in heading.lower() if c.isalnum() or c in "-_ ").replace(" ", "-")


if __name__ == "__main__":
    sys.stdout.write(markdown(openapi()))

"""The OpenAPI document as the server behaves: a refused body is a 400 with the route's error body (see
errors.py: OpenAI's, or Anthropic's on the Messages routes), not FastAPI's default 422 with its own shape,
and every route may answer with that body."""

from __future__ import annotations

from typing import Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

_REFS = "#/components/schemas/"


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    type: Literal["error"]
    error: AnthropicErrorDetail


ERROR_BODIES = (ErrorResponse, AnthropicErrorResponse)  # by `ErrorFormat.schema`


def _error(description: str, schema: str) -> dict:
    return {"description": description, "content": {"application/json": {"schema": {"$ref": _REFS + schema}}}}


def install_openapi(app: FastAPI) -> None:
    routes = app.state.route_errors.routes  # (path_format: as the document writes a path, `{model}` not `{model:path}`)
    errors = {(m.lower(), r.path_format): r.errors for r in routes for m in getattr(r, "methods", ())}

    def openapi() -> dict:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
            used = set()
            for path, operations in doc.get("paths", {}).items():
                for method, op in operations.items():
                    schema = errors[method, path].schema if (method, path) in errors else ErrorResponse.__name__
                    used.add(schema)
                    responses = op.setdefault("responses", {})
                    if responses.pop("422", None) is not None:
                        responses["400"] = _error("Invalid request: malformed JSON, a missing or wrong field", schema)
                    responses["default"] = _error("Any other error (401, 404, 408, 413, 429, 500, 503)", schema)
            schemas = doc.setdefault("components", {}).setdefault("schemas", {})
            for unused in ("HTTPValidationError", "ValidationError"):
                schemas.pop(unused, None)
            for model in ERROR_BODIES:
                if model.__name__ in used:
                    defs = model.model_json_schema(ref_template=_REFS + "{model}")
                    schemas.update(defs.pop("$defs", {}))
                    schemas[model.__name__] = defs
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi

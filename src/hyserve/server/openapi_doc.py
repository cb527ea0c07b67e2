"""The OpenAPI document as the server behaves: a refused body is a 400 with the OpenAI error body (see
errors.py), not FastAPI's default 422 with its own shape, and every route may answer with that body."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

_REF = "#/components/schemas/ErrorResponse"


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail


def _error(description: str) -> dict:
    return {"description": description, "content": {"application/json": {"schema": {"$ref": _REF}}}}


def install_openapi(app: FastAPI) -> None:
    def openapi() -> dict:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
            for operations in doc.get("paths", {}).values():
                for op in operations.values():
                    responses = op.setdefault("responses", {})
                    if responses.pop("422", None) is not None:
                        responses["400"] = _error("Invalid request: malformed JSON, a missing or wrong field")
                    responses["default"] = _error("Any other error (401, 404, 408, 413, 429, 500, 503)")
            schemas = doc.setdefault("components", {}).setdefault("schemas", {})
            for unused in ("HTTPValidationError", "ValidationError"):
                schemas.pop(unused, None)
            defs = ErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}")
            schemas.update(defs.pop("$defs", {}))
            schemas["ErrorResponse"] = defs
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi

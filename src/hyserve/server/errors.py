"""Error bodies, never a traceback, each in its API's shape. A route says which shape it answers in (its
router's `ErrorFormat`, `routes.api_router`), not its path, so a new route cannot get another API's shape:
OpenAI's {"error": {"message", "type", "param", "code"}} or Anthropic's {"type": "error", "error": {...}}."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import BaseRoute, Match

log = logging.getLogger("hyserve.http")


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code


class BodyTooLarge(StarletteHTTPException):
    """A body over the limit, found while it streams in. An HTTPException, so that FastAPI passes it on
    instead of reporting a body it could not parse."""

    code = "request_too_large"

    def __init__(self, limit: int):
        super().__init__(413, f"request body over {limit} bytes")


def _text(s: str | None) -> str | None:
    """Echoed input may hold what UTF-8 cannot encode (a lone surrogate): never let that fail a reply."""
    return s.encode("utf-8", "replace").decode() if s is not None else None


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": _text(message), "type": type_, "param": _text(param), "code": code}}


ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def anthropic_body(status: int, message: str) -> dict:
    kind = ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": _text(message)}}


class ErrorFormat:
    """How one API surface reports an error: as a body (with its status) and as the last event of a stream
    cut off at shutdown (`run.CutOffQuietly`). OpenAI's: the error body, and in a stream a `data:` line
    holding it (the openai SDK raises on it). `schema`: its body's name in the OpenAPI document (`openapi_doc`)."""

    schema = "ErrorResponse"

    def body(self, status: int, message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
        return error_body(message, type_, param, code)

    def stream_error(self, status: int, message: str, code: str | None) -> bytes:
        return b"data: " + json.dumps(self.body(status, message, "server_error", None, code)).encode() + b"\r\n\r\n"


class ResponsesErrors(ErrorFormat):
    """The Responses API's: OpenAI's body, and in a stream its `error` event."""

    def stream_error(self, status: int, message: str, code: str | None) -> bytes:
        data = {"type": "error", "code": code, "message": _text(message), "param": None}
        return b"event: error\r\ndata: " + json.dumps(data).encode() + b"\r\n\r\n"


class AnthropicErrors(ErrorFormat):
    """Anthropic's Messages API's: the type follows the status (`ANTHROPIC_TYPES`), in a stream its `error` event."""

    schema = "AnthropicErrorResponse"

    def body(self, status: int, message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
        return anthropic_body(status, message)

    def stream_error(self, status: int, message: str, code: str | None) -> bytes:
        return b"event: error\r\ndata: " + json.dumps(anthropic_body(status, message)).encode() + b"\r\n\r\n"


OPENAI, RESPONSES, ANTHROPIC = ErrorFormat(), ResponsesErrors(), AnthropicErrors()


class RouteErrors:
    """The error format a request is answered in: its route's (`errors`, set by its router), also before
    routing has run (the guards refuse requests ahead of it: the route the path would reach); OpenAI's where
    no route serves the path (an unknown path, /openapi.json)."""

    def __init__(self, routes: Iterable[BaseRoute]):
        self.routes = list(routes)

    def of(self, scope) -> ErrorFormat:
        route = scope.get("route")
        if route is None and scope.get("type") == "http":
            route = next((r for r in self.routes if r.matches(scope)[0] != Match.NONE), None)
        return getattr(route, "errors", OPENAI)


def error_response(
    errors: ErrorFormat,
    status: int,
    message: str,
    type_: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
) -> JSONResponse:
    return JSONResponse(errors.body(status, message, type_, param, code), status_code=status)


def install_handlers(app: FastAPI, route_errors: RouteErrors) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error_response(route_errors.of(request.scope), exc.status, exc.message, exc.type, exc.param, exc.code)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        errors = route_errors.of(request.scope)
        found = exc.errors()
        first = found[0] if found else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        if first.get("type") == "json_invalid":
            return error_response(errors, 400, "request body is not valid JSON", code="invalid_json")
        param = ".".join(loc) or None
        msg = first.get("msg", "invalid request")
        if first.get("type") == "text_only":  # a content part: named as the client wrote it, messages[0].content[1]
            param = loc[0] + "".join(f"[{p}]" if p.isdigit() else f".{p}" for p in loc[1:])
            param += f"[{first['ctx']['part']}]"
            return error_response(errors, 400, msg, param=param, code="invalid_value")
        if first.get("type") == "missing":
            msg = f"missing required parameter: {param}"
        elif param:
            msg = f"invalid value for {param}: {msg}"
        code = "invalid_value" if first.get("type") != "missing" else "missing"
        return error_response(errors, 400, msg, param=param, code=code)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        errors = route_errors.of(request.scope)
        return error_response(errors, exc.status_code, str(exc.detail), kind, code=getattr(exc, "code", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("unhandled error")
        return error_response(route_errors.of(request.scope), 500, "internal server error", "server_error")

"""OpenAI-style error bodies: {"error": {"message", "type", "param", "code"}}, never a traceback."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

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


ANTHROPIC_PATH = "/v1/messages"  # its routes answer in Anthropic's shape: {"type": "error", "error": {...}}
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


def error_response(
    status: int,
    message: str,
    type_: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
    path: str = "",
) -> JSONResponse:
    if path.startswith(ANTHROPIC_PATH):
        return JSONResponse(anthropic_body(status, message), status_code=status)
    return JSONResponse(error_body(message, type_, param, code), status_code=status)


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error_response(exc.status, exc.message, exc.type, exc.param, exc.code, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        path = request.url.path
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        if first.get("type") == "json_invalid":
            return error_response(400, "request body is not valid JSON", code="invalid_json", path=path)
        param = ".".join(loc) or None
        msg = first.get("msg", "invalid request")
        if first.get("type") == "text_only":  # a content part: named as the client wrote it, messages[0].content[1]
            param = loc[0] + "".join(f"[{p}]" if p.isdigit() else f".{p}" for p in loc[1:])
            param += f"[{first['ctx']['part']}]"
            return error_response(400, msg, param=param, code="invalid_value", path=path)
        if first.get("type") == "missing":
            msg = f"missing required parameter: {param}"
        elif param:
            msg = f"invalid value for {param}: {msg}"
        code = "invalid_value" if first.get("type") != "missing" else "missing"
        return error_response(400, msg, param=param, code=code, path=path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(
            exc.status_code, str(exc.detail), kind, code=getattr(exc, "code", None), path=request.url.path
        )

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("unhandled error")
        return error_response(500, "internal server error", "server_error", path=request.url.path)

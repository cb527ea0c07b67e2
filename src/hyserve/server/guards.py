"""Request guards in front of the API: body size limit, API-key check, draining on shutdown.

Plain ASGI middleware, so an oversized body is refused while it streams in, before any parsing.
"""

from __future__ import annotations

import hashlib
import hmac
import json

from ..service import Service

OPEN_PATHS = ("/health", "/metrics")


def tenant_salt(api_key: str | None, cache_salt: str | None) -> str:
    """Prefix-cache namespace: the API key's hash plus the request's own `cache_salt`."""
    key = hashlib.sha256(api_key.encode()).hexdigest()[:16] if api_key else ""
    return f"{key}:{cache_salt or ''}" if (key or cache_salt) else ""


def bearer(scope) -> str | None:
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            v = value.decode("latin-1")
            return v[7:].strip() if v.lower().startswith("bearer ") else None
    return None


async def _send_error(send, status: int, message: str, type_: str, code: str | None) -> None:
    body = json.dumps({"error": {"message": message, "type": type_, "param": None, "code": code}}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class GuardMiddleware:
    def __init__(self, app, service: Service):
        self.app = app
        self.service = service

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        cfg = self.service.config
        path = scope.get("path", "")
        if self.service.draining and path not in OPEN_PATHS:
            return await _send_error(send, 503, "server is shutting down", "server_error", "shutting_down")
        if cfg.api_keys and path.startswith("/v1"):
            key = bearer(scope)
            if key is None or not any(hmac.compare_digest(key, k) for k in cfg.api_keys):
                return await _send_error(send, 401, "Incorrect or missing API key: send 'Authorization: Bearer "
                                         "<key>'", "invalid_request_error", "invalid_api_key")
        limit = cfg.max_body_bytes
        for name, value in scope.get("headers", ()):
            if name == b"content-length" and value.isdigit() and int(value) > limit:
                return await _send_error(send, 413, f"request body over {limit} bytes", "invalid_request_error",
                                         "request_too_large")
        seen = 0

        async def limited_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise _TooLarge()
            return message

        try:
            await self.app(scope, limited_receive, send)
        except _TooLarge:
            await _send_error(send, 413, f"request body over {limit} bytes", "invalid_request_error",
                              "request_too_large")


class _TooLarge(Exception):
    pass

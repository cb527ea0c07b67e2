"""Request guards in front of the API: body size limit, API-key check, draining on shutdown.

Plain ASGI middleware, so an oversized body is refused while it streams in, before any parsing.
"""

from __future__ import annotations

import hashlib
import hmac
import json

from ..cache.namespace import make_salt
from ..service import Service, ServiceConfig
from .errors import BodyTooLarge, ErrorFormat, RouteErrors

OPEN_PATHS = ("/health", "/metrics")
API_KEY = "hyserve.api_key"  # scope entry: the configured key (API or admin) the request presented


def key_tenant(api_key: str | None) -> str:
    """A tenant's name in the cache: its API key's hash, "" for keyless requests."""
    return hashlib.sha256(api_key.encode()).hexdigest()[:16] if api_key else ""


def tenant_salt(api_key: str | None, cache_salt: str | None) -> str:
    """Prefix-cache namespace: the API key's hash plus the request's own `cache_salt`."""
    return make_salt(key_tenant(api_key), cache_salt)


def bearer(scope) -> bytes | None:
    """The token of `Authorization: Bearer <token>`, else of `x-api-key` (Anthropic's clients), as sent
    (bytes: a header need not be ASCII)."""
    key = None
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            return value[7:].strip() if value[:7].lower() == b"bearer " else None
        if name == b"x-api-key":
            key = value.strip()
    return key


def matching_key(token: bytes | None, cfg: ServiceConfig) -> str | None:
    """The configured key (API or admin) equal to `token`, compared in constant time, or None."""
    if token is None:
        return None
    found = None
    for key in (*cfg.api_keys, *([cfg.admin_api_key] if cfg.admin_api_key else [])):
        if hmac.compare_digest(token, key.encode()):
            found = key
    return found


def cache_scope(scope, cfg: ServiceConfig) -> str | None:
    """Whose cache an admin route acts on: None (all of it) for the admin key or a server without keys,
    else the caller's own tenant."""
    key = scope.get(API_KEY)
    if cfg.admin_api_key and key == cfg.admin_api_key:
        return None
    if not cfg.api_keys and not cfg.admin_api_key:
        return None
    return key_tenant(key if cfg.api_keys else None)


async def send_error(
    send, errors: ErrorFormat, status: int, message: str, type_: str, code: str | None, close: bool = False
) -> None:
    """An error answered outside the app (no route has run), in the shape of the route it was meant for."""
    body = json.dumps(errors.body(status, message, type_, None, code)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class GuardMiddleware:
    def __init__(self, app, service: Service, route_errors: RouteErrors):
        self.app = app
        self.service = service
        self.route_errors = route_errors

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        cfg = self.service.config
        if scope.get("path", "") in OPEN_PATHS:
            return await self.app(scope, receive, send)

        def refuse(status: int, message: str, type_: str, code: str, close: bool = False):
            return send_error(send, self.route_errors.of(scope), status, message, type_, code, close)

        if self.service.draining:
            return await refuse(503, "server is shutting down", "server_error", "shutting_down", close=True)
        scope[API_KEY] = key = matching_key(bearer(scope), cfg)
        if cfg.api_keys and key is None:  # every route but the probes, /openapi.json too
            return await refuse(
                401,
                "Incorrect or missing API key: send 'Authorization: Bearer <key>'",
                "invalid_request_error",
                "invalid_api_key",
            )
        limit = cfg.max_body_bytes
        for name, value in scope.get("headers", ()):
            if name == b"content-length" and value.isdigit() and int(value) > limit:
                return await refuse(413, f"request body over {limit} bytes", "invalid_request_error", BodyTooLarge.code)
        seen = 0

        async def limited_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:  # an HTTPException, so the framework answers 413, not "cannot parse"
                    raise BodyTooLarge(limit)
            return message

        self.service.inflight += 1
        try:
            await self.app(scope, limited_receive, send)
        except BodyTooLarge as exc:  # raised outside a route (none read bodies there today)
            await refuse(413, exc.detail, "invalid_request_error", exc.code)
        finally:
            self.service.inflight -= 1

"""Refuse JSON bodies holding a lone UTF-16 surrogate (`"\\ud800"`), anywhere, with a 400 naming the field.

JSON may escape one; Python decodes it into a str that UTF-8 cannot encode, so the tokenizer, an error
message echoing it or a log line would fail later with a 500. Checked once, in the route, before the
body is validated."""

from __future__ import annotations

import json
import re

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute

# an escaped high surrogate not followed by a low one, or a low one not preceded by a high one: a cheap
# filter on the raw bytes, so that only suspect bodies are decoded twice
_LONE = re.compile(
    rb"\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F][0-9a-fA-F]{2})"
    rb"|(?<!\\u[dD][89abAB][0-9a-fA-F]{2})\\u[dD][c-fC-F][0-9a-fA-F]{2}"
)


def _encodable(s: str) -> bool:
    try:
        s.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def lone_surrogate_path(value) -> list | None:
    """The path (keys and indexes) of the first string or key in `value` that UTF-8 cannot encode."""
    stack = [((), value)]
    while stack:
        path, v = stack.pop()
        if isinstance(v, str):
            if not _encodable(v):
                return list(path)
        elif isinstance(v, dict):
            for k, item in v.items():
                if not _encodable(k):
                    return [*path, k]
                stack.append(((*path, k), item))
        elif isinstance(v, list):
            stack.extend(((*path, i), item) for i, item in enumerate(v))
    return None


class StrictJSONRoute(APIRoute):
    def get_route_handler(self):
        handler = super().get_route_handler()

        async def checked(request: Request):
            body = await request.body()  # kept on the request: FastAPI reads it from there
            if body and _LONE.search(body):
                try:
                    path = lone_surrogate_path(json.loads(body))
                except (ValueError, RecursionError):
                    path = None  # not JSON FastAPI can read: its own parsing answers that
                if path is not None:
                    raise RequestValidationError(
                        [
                            {
                                "type": "string_unicode",
                                "loc": ("body", *path),
                                "msg": "text holds a lone UTF-16 surrogate",
                                "input": None,
                            }
                        ]
                    )
            return await handler(request)

        return checked

"""One HTTP request through an ASGI app in this process, as a stream: first the head
({"status", "headers"}), then the body's chunks. A replica runs the single-server app this way, so the
API, errors, auth and streaming behind several replicas are exactly a single server's."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass


@dataclass
class HTTPRequest:
    """What the routing process forwards: the request as it arrived (headers as latin-1 text pairs)."""

    method: str
    path: str
    query: str
    headers: list[tuple[str, str]]
    body: bytes


async def call(app, req: HTTPRequest) -> AsyncIterator[dict | bytes]:
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": req.method,
        "scheme": "http",
        "path": req.path,
        "raw_path": req.path.encode(),
        "query_string": req.query.encode("latin-1"),
        "root_path": "",
        "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in req.headers],
        "client": ("127.0.0.1", 0),
        "server": ("127.0.0.1", 80),
    }
    out: asyncio.Queue = asyncio.Queue()
    gone = asyncio.Event()  # the caller stopped reading: the app sees a disconnect
    body_sent = False

    async def receive():
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": req.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        await out.put(message)

    async def run():
        try:
            await app(scope, receive, send)
        finally:
            await out.put(None)

    task = asyncio.create_task(run())
    try:
        while True:
            message = await out.get()
            if message is None:
                break
            if message["type"] == "http.response.start":
                yield {
                    "status": message["status"],
                    "headers": [(k.decode("latin-1"), v.decode("latin-1")) for k, v in message.get("headers", [])],
                }
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield bytes(message["body"])
                if not message.get("more_body"):
                    break
    finally:
        gone.set()
        if not task.done():
            try:
                await asyncio.wait_for(asyncio.shield(task), 5)
            except (TimeoutError, Exception):
                task.cancel()

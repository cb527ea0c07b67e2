"""One generation request sent to the engine and its items turned into the reply: a server-sent event
stream, or one JSON body once every choice has finished. `body.n` choices share the request's prefill
(`choices.siblings`); the reply's shape is its `Format`'s."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from fastapi import Request
from fastapi.responses import JSONResponse
from sse_starlette.sse import EventSourceResponse

from ..cache.namespace import tenant_of
from ..engine import SHUTTING_DOWN, Delta, Failed, Finished, GenerationRequest, QueueFull
from ..service import Service
from .access import track
from .choices import merged, siblings
from .errors import APIError
from .formats import Format, usage
from .ignored import ignored_headers
from .schemas import SamplingFields

PING_SECONDS = 15  # a comment line on an idle stream, so proxies keep it open


class Generation:
    """`req` and its n - 1 siblings in the engine, each with its `Format` (`make_format()` per choice);
    `endpoint` labels the metrics and the ignored-fields log line."""

    def __init__(
        self,
        service: Service,
        endpoint: str,
        body: SamplingFields,
        req: GenerationRequest,
        request: Request,
        make_format: Callable[[], Format],
    ):
        self.service, self.endpoint, self.body, self.request = service, endpoint, body, request
        self.reqs = siblings(req, body.n)
        self.formats = [make_format() for _ in self.reqs]
        first = self.formats[0]
        rid = req.request_id = first.id  # one id in headers, responses and cache events
        self.headers = {"X-Request-Id": rid, **ignored_headers(body, endpoint)}
        for i, (r, fmt) in enumerate(zip(self.reqs, self.formats)):
            fmt.id, fmt.created, fmt.index = rid, first.created, i
            if i:
                r.request_id = f"{rid}-{i}"
            service.cache.telemetry.bind(r.request_id, tenant_of(r.cache_salt))  # its events are its tenant's

    async def reply(self):
        """Queue the requests (a 429 when the engine's queue is full) and answer: streamed or whole."""
        streams = []
        try:
            for i, r in enumerate(self.reqs):
                stream = self.service.engine.stream(r)
                streams.append(track(self.request.scope, r, stream) if i == 0 else stream)  # for the access line
        except QueueFull as exc:
            self.cancel()
            self.count("rejected")
            raise APIError(429, str(exc), "rate_limit_error", None, "rate_limit_exceeded") from exc
        items = merged(streams)
        if self.body.stream:
            return EventSourceResponse(self.events(items), ping=PING_SECONDS, headers=self.headers)
        return JSONResponse(await self.whole(items), headers=self.headers)

    def cancel(self) -> None:
        for r in self.reqs:
            r.cancelled.set()

    def count(self, status: str) -> None:
        self.service.metrics.requests.labels(self.endpoint, status).inc()

    async def events(self, items):
        """The stream: each format's start, deltas and final chunks; a failure ends it in the format's way."""
        fmts, status, finals = self.formats, "ok", [None] * len(self.reqs)
        try:
            for fmt in fmts:
                for chunk in fmt.start():
                    yield fmt.event(chunk)
            async for i, item in items:
                if isinstance(item, Delta):
                    chunks = fmts[i].delta(item)
                elif isinstance(item, Finished) and item.reason == "timeout":
                    status, i = "timeout", 0
                    chunks = fmts[0].failure("request timed out", "timeout", "request_timeout")
                elif isinstance(item, Finished):
                    finals[i] = item
                    chunks = fmts[i].final(item)
                    if self.body.include_usage and all(finals):
                        chunks += fmts[0].usage_chunks(usage(*finals))
                elif isinstance(item, Failed):
                    status, i = "error", 0
                    chunks = fmts[0].failure(item.message, "server_error", item.code)
                else:
                    continue
                for chunk in chunks:
                    yield fmts[i].event(chunk)
            if fmts[0].done is not None:
                yield {"data": fmts[0].done}
        except asyncio.CancelledError:
            status = "cancelled"
            raise
        finally:
            self.cancel()
            await items.aclose()
            self.count(status)

    async def whole(self, items) -> dict:
        """The whole reply once every choice has finished; a failure or timeout is an error response."""
        watcher = asyncio.create_task(self.watch_disconnect())
        results: list = [None] * len(self.reqs)
        try:
            async for i, item in items:
                if isinstance(item, (Finished, Failed)):
                    results[i] = item
        finally:
            watcher.cancel()
            self.cancel()
            await items.aclose()
        failed = next((r for r in results if isinstance(r, Failed) or r is None), False)
        if failed is not False:
            self.count("error")
            if failed and failed.code == SHUTTING_DOWN:
                raise APIError(503, failed.message, "server_error", None, SHUTTING_DOWN)
            raise APIError(500, failed.message if failed else "generation failed", "server_error")
        if any(r.reason == "timeout" for r in results):
            self.count("timeout")
            raise APIError(
                408,
                f"request timed out after {self.service.config.request_timeout} s",
                "timeout",
                None,
                "request_timeout",
            )
        self.count("cancelled" if any(r.reason == "cancelled" for r in results) else "ok")
        return self.formats[0].response(results, self.formats)

    async def watch_disconnect(self) -> None:
        """A client gone before its whole reply cancels the generation (a stream's end cancels it already)."""
        first = self.reqs[0]
        while not first.cancelled.is_set():
            if await self.request.is_disconnected():
                self.cancel()
                return
            await asyncio.sleep(0.05)

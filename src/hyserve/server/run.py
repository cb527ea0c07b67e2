"""Run the app on a real uvicorn server in a background thread (demo, tests, benchmarks)."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import threading
import time

import uvicorn

from ..engine import SHUTTING_DOWN
from ..service import Service
from .app import create_app
from .guards import send_error

log = logging.getLogger("hyserve.server")

CUT_OFF = "server is shutting down: the reply was cut off at the --graceful-shutdown limit"
CUT_OFF_DELIVERY = 2.0  # seconds the streams cut off get to send their error event before the sockets close


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class DrainingServer(uvicorn.Server):
    """uvicorn, plus: on SIGTERM/SIGINT mark the service draining and keep listening while requests are
    in flight, so a request arriving then gets a 503 with an OpenAI error body (uvicorn alone would stop
    accepting connections at once). Once none is left, or after `timeout_graceful_shutdown` seconds,
    uvicorn's own shutdown closes the sockets and cancels whatever still runs: first the engine fails the
    requests still running, so each reply ends with an explicit error in its route's format, never looking
    complete (`Engine.cut_off`). It says what it waits for;
    a second signal exits at once. A graceful stop ends with exit status 0 and no traceback (uvicorn
    would re-raise the signal, and Python turns a SIGINT into a KeyboardInterrupt traceback)."""

    def __init__(self, config: uvicorn.Config, service: Service):
        super().__init__(config)
        self.service = service
        self.stop_reason: str | None = None

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started:  # uvicorn logs no address for sockets handed to it
            rt, host = self.service.runtime, self.config.host
            log.info(
                "serving %s (%s) on http://%s:%d/v1 (Ctrl-C to stop)",
                self.service.model_name,
                rt.model.config.model_type,
                f"[{host}]" if ":" in host else host,
                self.config.port,
            )

    def handle_exit(self, sig, frame) -> None:
        if self.should_exit:
            exit_now(sig, self.service.inflight)
        self.stop_reason = signal.Signals(sig).name
        self.service.draining = True
        self.should_exit = True  # logged from `shutdown`, on the event loop, not in the signal handler

    async def shutdown(self, sockets=None) -> None:
        loop = asyncio.get_running_loop()
        budget = self.config.timeout_graceful_shutdown
        deadline = None if budget is None else loop.time() + budget
        waiting = self.service.inflight
        if waiting:
            log.info(
                "%s: finishing %d request(s) in flight, for at most %s (--graceful-shutdown); new requests "
                "get 503. Ctrl-C (or another SIGTERM) exits at once",
                self.stop_reason or "stopping",
                waiting,
                "ever" if budget is None else f"{budget:g} s",
            )
        else:
            log.info("%s: no request in flight, stopping", self.stop_reason or "stopping")
        while self.service.inflight and not self.force_exit and (deadline is None or loop.time() < deadline):
            await asyncio.sleep(0.05)
        if self.service.inflight:
            log.warning("graceful shutdown time is up: ending %d request(s) still running", self.service.inflight)
            if self.service.engine.cut_off(CUT_OFF):
                end = loop.time() + CUT_OFF_DELIVERY
                while self.service.inflight and not self.force_exit and loop.time() < end:
                    await asyncio.sleep(0.02)
        elif waiting:
            log.info("all requests finished")
        if deadline is not None:  # what is left of the budget is uvicorn's
            self.config.timeout_graceful_shutdown = max(0.0, deadline - loop.time())
        await super().shutdown(sockets)


class CutOffQuietly:
    """When the graceful budget runs out, uvicorn cancels the requests still running and logs each as an
    "Exception in ASGI application" traceback. A cut-off is a designed end, not a failure: answer one that
    has not started its response with the 503 that draining requests get, and end a started stream with an
    error event in its route's format (one the engine had not cut off first: `Engine.cut_off`)."""

    def __init__(self, app, service: Service):
        self.app, self.service = app, service
        self.route_errors = app.state.route_errors

    async def __call__(self, scope, receive, send):
        started = complete = False
        events = False  # a server-sent event stream

        async def watching_send(message):
            nonlocal started, complete, events
            if message["type"] == "http.response.start":
                started = True
                events = any(
                    k == b"content-type" and v.startswith(b"text/event-stream") for k, v in message.get("headers", ())
                )
            complete = complete or (message["type"] == "http.response.body" and not message.get("more_body"))
            await send(message)

        try:
            await self.app(scope, receive, watching_send)
        except asyncio.CancelledError:
            if not self.service.draining or scope["type"] != "http":
                raise
            errors = self.route_errors.of(scope)
            if not started:
                await send_error(send, errors, 503, "server is shutting down", "server_error", SHUTTING_DOWN, True)
            elif not complete:  # a stream ends with its route's error event
                body = errors.stream_error(503, CUT_OFF, SHUTTING_DOWN) if events else b""
                await send({"type": "http.response.body", "body": body, "more_body": False})


def exit_now(sig: int, inflight: int) -> None:
    """The second signal: end the process at once. os._exit skips interpreter shutdown, which would wait on
    (or abort inside) the model thread's running forward pass; the status is the shell's 128 + signal."""
    name = signal.Signals(sig).name
    log.warning("%s again: exiting now%s", name, f", {inflight} request(s) cut off" if inflight else "")
    for handler in logging.getLogger().handlers:
        handler.flush()
    os._exit(128 + sig)


def draining_server(service: Service, host: str, port: int, graceful_seconds: float | None) -> DrainingServer:
    """The server `serve_forever` runs (tests run it on a thread of their own)."""
    from sse_starlette.sse import AppStatus

    # sse-starlette would cut every open stream on SIGTERM; let them finish, bounded by uvicorn's timeout.
    AppStatus.disable_automatic_graceful_drain()
    # log_config=None: the CLI has set logging up (`logs.configure`); hyserve writes the access lines
    app = CutOffQuietly(create_app(service), service)
    config = uvicorn.Config(
        app, host=host, port=port, log_config=None, access_log=False, timeout_graceful_shutdown=graceful_seconds
    )
    return DrainingServer(config, service)


def serve_forever(service: Service, sock: socket.socket, graceful_seconds: float = 30.0) -> None:
    """Serve on `sock` (bound and listening, see `preflight.bind`) until a signal, then drain."""
    host, port = sock.getsockname()[:2]
    try:
        draining_server(service, host, port, graceful_seconds).run(sockets=[sock])
    finally:
        service.engine.stop()
        if service.cache.disk is not None:
            service.cache.disk.close()  # finish queued writes: a graceful stop keeps them
        log.info("stopped")


class BackgroundServer:
    def __init__(self, service: Service, host: str = "127.0.0.1", port: int | None = None):
        self.service = service
        self.host, self.port = host, port or free_port()
        config = uvicorn.Config(
            create_app(service), host=self.host, port=self.port, log_level="warning", lifespan="off"
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="hyserve-uvicorn", daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __enter__(self) -> BackgroundServer:
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            if time.time() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)

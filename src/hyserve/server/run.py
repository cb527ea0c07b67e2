"""Run the app on a real uvicorn server in a background thread (demo, tests, benchmarks)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import uvicorn

from ..service import Service
from .app import create_app


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class DrainingServer(uvicorn.Server):
    """uvicorn, plus: on SIGTERM/SIGINT mark the service draining and keep listening while requests are
    in flight, so a request arriving then gets a 503 with an OpenAI error body (uvicorn alone would stop
    accepting connections at once). Once none is left, or after `timeout_graceful_shutdown` seconds,
    uvicorn's own shutdown closes the sockets and cancels whatever still runs."""

    def __init__(self, config: uvicorn.Config, service: Service):
        super().__init__(config)
        self.service = service

    def handle_exit(self, sig, frame) -> None:
        self.service.draining = True
        super().handle_exit(sig, frame)

    async def shutdown(self, sockets=None) -> None:
        loop = asyncio.get_running_loop()
        budget = self.config.timeout_graceful_shutdown
        deadline = None if budget is None else loop.time() + budget
        while self.service.inflight and not self.force_exit and (deadline is None or loop.time() < deadline):
            await asyncio.sleep(0.05)
        if deadline is not None:  # what is left of the budget is uvicorn's
            self.config.timeout_graceful_shutdown = max(0.0, deadline - loop.time())
        await super().shutdown(sockets)


def serve_forever(service: Service, host: str, port: int, graceful_seconds: float = 30.0) -> None:
    from sse_starlette.sse import AppStatus

    # sse-starlette would cut every open stream on SIGTERM; let them finish, bounded by uvicorn's timeout.
    AppStatus.disable_automatic_graceful_drain()
    config = uvicorn.Config(create_app(service), host=host, port=port, log_level="warning",
                            timeout_graceful_shutdown=graceful_seconds)
    try:
        DrainingServer(config, service).run()
    finally:
        service.engine.stop()


class BackgroundServer:
    def __init__(self, service: Service, host: str = "127.0.0.1", port: int | None = None):
        self.service = service
        self.host, self.port = host, port or free_port()
        config = uvicorn.Config(create_app(service), host=self.host, port=self.port, log_level="warning",
                                lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="hyserve-uvicorn", daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __enter__(self) -> "BackgroundServer":
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

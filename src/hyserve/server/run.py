"""Run the app on a real uvicorn server in a background thread (demo, tests, benchmarks)."""

from __future__ import annotations

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
    """uvicorn, plus: on SIGTERM/SIGINT mark the service draining (new requests 503) while uvicorn lets
    running requests finish for up to `timeout_graceful_shutdown` seconds."""

    def __init__(self, config: uvicorn.Config, service: Service):
        super().__init__(config)
        self.service = service

    def handle_exit(self, sig, frame) -> None:
        self.service.draining = True
        super().handle_exit(sig, frame)


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

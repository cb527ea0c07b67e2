"""`hyserve serve MODEL --replicas N`: start a local Ray cluster (or join one with `--ray-address`), deploy the
replicas behind Ray Serve's HTTP proxy on --host/--port, and serve until Ctrl-C or SIGTERM."""

from __future__ import annotations

import logging
import signal
import threading

from ..service import ServiceConfig

log = logging.getLogger("hyserve.scale")

APP_NAME = "hyserve"


def start(
    config: ServiceConfig,
    replicas: int,
    host: str,
    port: int,
    ray_address: str | None = None,
    replica_cpus: float = 1.0,
    threads: int = 1,
    **app_options,
) -> None:
    """Deploy (blocking until every replica has loaded the model). Raises on failure."""
    import ray
    from ray import serve

    from .deployment import build_app

    if not ray.is_initialized():
        ray.init(
            address=ray_address,
            include_dashboard=False,
            logging_level=logging.WARNING,
            log_to_driver=log.isEnabledFor(logging.DEBUG),
        )
    cpus = ray.cluster_resources().get("CPU", 0.0)
    if replicas * replica_cpus > cpus + 1e-9:
        raise RuntimeError(
            f"{replicas} replicas of {replica_cpus:g} CPU each need {replicas * replica_cpus:g} CPUs; "
            f"the Ray cluster has {cpus:g} (lower --replica-cpus or --replicas)"
        )
    serve.start(http_options={"host": host, "port": port})
    serve.run(
        build_app(config, replicas, replica_cpus=replica_cpus, threads=threads, **app_options),
        name=APP_NAME,
        route_prefix="/",
        blocking=False,
    )


def stop() -> None:
    import ray
    from ray import serve

    try:
        serve.delete(APP_NAME)
        serve.shutdown()
    finally:
        ray.shutdown()


def serve_replicas(
    config: ServiceConfig,
    replicas: int,
    host: str,
    port: int,
    ray_address: str | None,
    replica_cpus: float,
    threads: int,
) -> int:
    try:
        start(config, replicas, host, port, ray_address, replica_cpus, threads)
    except Exception as exc:
        log.error("cannot start the replicas: %s: %s", type(exc).__name__, exc)
        stop()
        return 2
    log.info(
        "serving %s on http://%s:%d/v1 with %d replicas on Ray Serve (Ctrl-C to stop)",
        config.model_name,
        f"[{host}]" if ":" in host else host,
        port,
        replicas,
    )
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    done.wait()
    log.info("stopping the replicas")
    stop()
    log.info("stopped")
    return 0

"""The Ray Serve side: engine replicas, the request router that applies `router.CheckpointRouting`, and the
ingress that takes HTTP requests, renders their prompts and forwards them.

Each engine replica runs the single-server app in-process (`bridge`), so everything the API does is what
one hyserve process does. The ingress only routes: it answers itself only when no replica can
(a replica died under a request: the request is sent once more if nothing of it reached the client yet,
else it ends with a 503 / an error event), and for /metrics (its routing metrics plus every replica's)."""

# no `from __future__ import annotations`: FastAPI reads the ingress route's annotations in the replica,
# where Ray has rebuilt the class with only the globals its code names

import asyncio
import copy
import functools
import json
import logging
import uuid
from typing import Any

import ray
from fastapi import FastAPI, Request
from prometheus_client import CollectorRegistry, generate_latest
from ray import serve
from ray.serve.config import RequestRouterConfig
from starlette.responses import JSONResponse, Response, StreamingResponse

from ..service import ServiceConfig
from .bridge import HTTPRequest
from .routed import PLACED, TELEMETRY, Routed, replica_ids
from .transfer import Transfers, worth_fetching

log = logging.getLogger("hyserve.scale")

ROUTER = "hyserve.scale.request_router.CheckpointRequestRouter"


# -- the engine replica ---------------------------------------------------------------------------------
class EngineReplica:
    """One hyserve engine and its app; `forward` streams one HTTP request's response (`bridge.call`)."""

    def __init__(
        self,
        config: ServiceConfig,
        threads: int = 1,
        prefill_tokens_per_s: float = 1000.0,
        transfer_bytes_per_s: float = 500e6,
    ):
        from ..process_settings import apply

        apply()  # a replica is a process hyserve runs (on a cluster the CLI's settings may not reach)
        import torch
        from sse_starlette.sse import AppStatus

        from ..server.app import create_app
        from ..service import build_service
        from .publish import Published

        torch.set_num_threads(threads)
        AppStatus.disable_automatic_graceful_drain()  # a replica's streams end with their requests
        self.service = build_service(config)
        self.app = create_app(self.service)
        self.published = Published()
        with self.service.runtime.lock:
            self.published.attach(self.service.cache.tree)
        context = serve.get_replica_context()
        self.replica_id = context.replica_id.unique_id
        self.deployment = (context.deployment, context.app_name)
        self.transfers = Transfers(self.service)
        self.prefill_tokens_per_s, self.transfer_bytes_per_s = prefill_tokens_per_s, transfer_bytes_per_s
        self._peers = None  # a handle to this deployment's replicas, made when first needed

    async def forward(self, routed: Routed, req: HTTPRequest):
        """The response to `req`: its head (with the replica's id in `x-hyserve-replica`), then its body."""
        from .bridge import call

        if routed.fetch_from not in (None, self.replica_id) and routed.tokens:
            await self.fetch(routed)
        async for item in call(self.app, req):
            if isinstance(item, dict):
                item["headers"].append(("x-hyserve-replica", self.replica_id))
            yield item

    async def fetch(self, routed: Routed) -> None:
        """Take the deepest checkpoint of the prompt from the replica the router passed over, if it is deeper
        than any here and its bytes move faster than its tokens prefill; on any failure the request runs cold."""
        tokens, salt = routed.tokens[:-1], routed.salt  # the last prompt token always runs
        with self.service.runtime.lock:
            here = self.service.cache.tree.lookup(tokens, len(tokens), False, salt)
        have = here.length if here is not None else 0
        if have >= routed.fetch_tokens:
            return
        try:
            if self._peers is None:
                self._peers = serve.get_deployment_handle(*self.deployment)
            ask = Routed(routed.request_id, target=routed.fetch_from)
            package = await asyncio.wait_for(
                self._peers.export.remote(
                    ask, salt, tokens, have, self.prefill_tokens_per_s, self.transfer_bytes_per_s
                ),
                timeout=30,
            )
        except Exception as exc:  # the holder died, is stuck, or the transport failed
            log.warning(
                "fetching a checkpoint from replica %s failed: %s: %s", routed.fetch_from, type(exc).__name__, exc
            )
            return
        if package is not None:
            await asyncio.get_running_loop().run_in_executor(
                None, self.transfers.take, package, salt, tokens[: package.num_tokens], routed.request_id
            )

    def export(
        self,
        routed: Routed,
        salt: str,
        tokens: list[int],
        deeper_than: int,
        prefill_tokens_per_s: float,
        transfer_bytes_per_s: float,
    ):
        """For another replica: the deepest checkpoint of `tokens` held here, packed (`transfer.Package`), if
        it is deeper than theirs and worth moving; else None."""
        return self.transfers.export(
            salt, tokens, deeper_than, worth_fetching(prefill_tokens_per_s, transfer_bytes_per_s)
        )

    def record_routing_stats(self) -> dict:
        sched = self.service.engine.scheduler
        return {
            "checkpoints": self.published.checkpoints(),
            "version": self.published.version,
            "running": len(sched.running),
            "waiting": len(sched.waiting),
        }

    def check_health(self) -> None:
        problem = self.service.engine.problem()
        if problem is not None:  # Ray Serve replaces a replica whose engine keeps failing or hangs
            raise RuntimeError(problem)

    def __del__(self):
        service = getattr(self, "service", None)
        if service is not None:
            service.engine.stop()


# -- the ingress ----------------------------------------------------------------------------------------
RETRYABLE = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)


def _died(exc: BaseException) -> bool:
    return isinstance(exc, RETRYABLE) or "ActorDiedError" in type(exc).__name__


def _unavailable(exc: BaseException, scope):
    """Ray could not take or run the request (not a replica's death): 429 when every replica's queue is full,
    else 503, in the route's error shape."""
    from ray.serve.exceptions import BackPressureError

    log.warning("request not served: %s: %s", type(exc).__name__, exc)
    if isinstance(exc, BackPressureError):
        return _error(
            scope, 429, "every replica's queue is full; try again later", "rate_limit_exceeded", "rate_limit_error"
        )
    return _error(scope, 503, f"no replica could serve this request ({type(exc).__name__})", "replica_unavailable")


def _error(scope, status: int, message: str, code: str | None, kind: str = "server_error") -> Response:
    """An error the ingress answers itself, in the shape of the route the request (`scope`) was for
    (`server.errors`; looked up only when there is an error to answer)."""
    body = _route_errors().of(scope).body(status, message, kind, None, code)
    return JSONResponse(body, status_code=status)


@functools.cache
def _route_errors():
    from ..server.app import route_errors  # the server's routes: imported once, when the first error needs them

    return route_errors()


class Ingress:
    """Takes HTTP requests (behind Ray Serve's proxy), forwards each to an engine replica and streams the
    answer back. Holds a response's head and first chunk until a second chunk (or its end) arrives, so a
    request whose replica dies before anything of it was generated can be sent again, once."""

    def __init__(self, engine, config: ServiceConfig):
        from .keys import PromptKeys

        self.engine = engine
        self.config = config
        self.keys = PromptKeys(config)

    async def handle(self, request):
        path = request.url.path
        if path == "/metrics" and request.method == "GET":
            return Response(await self.metrics(), media_type="text/plain; version=0.0.4; charset=utf-8")
        if path == "/v1/routing/events" and request.method == "GET":
            return self.routing_events(request)
        if path in ("/v1/cache", "/v1/cache/events"):  # every replica's cache, not one's
            return await self.every_cache(request)
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in request.scope["headers"]]
        limit = self.config.max_body_bytes
        if not self.keys.admitted(request.scope["headers"])[0]:
            # the API key first: the replica refuses this one from its headers (401), so its body is never read,
            # parsed or rendered here; it is routed by load
            body, routed = b"", Routed(uuid.uuid4().hex)
            headers = [(k, v) for k, v in headers if k.lower() not in _DROP] + [("content-length", "0")]
        else:
            body = await _capped_body(request, limit)
            if body is None:  # the replica answers 413 from the length, as a single server does (after its auth check)
                body = b""
                headers = [(k, v) for k, v in headers if k.lower() not in _DROP] + [("content-length", str(limit + 1))]
            salt, tokens = await asyncio.get_running_loop().run_in_executor(
                None, self.keys.of, path, request.scope["headers"], body
            )
            routed = Routed(uuid.uuid4().hex, salt, tokens, _messages(path, body))
        req = HTTPRequest(request.method, path, request.scope.get("query_string", b"").decode("latin-1"), headers, body)
        for attempt in (0, 1):
            stream = self.engine.options(stream=True).forward.remote(routed, req)
            held: list = []
            try:
                async for item in stream:
                    held.append(item)
                    if len(held) >= 3:  # head + two chunks: generation has started
                        break
                else:  # the whole response arrived
                    return _response(held)
            except Exception as exc:
                if not _died(exc):
                    return _unavailable(exc, request.scope)
                replica = PLACED.pop(routed.request_id, "")
                if attempt == 0:
                    TELEMETRY.failed(replica, "retried", routed.request_id)
                    routed.avoid = replica or None
                    continue
                TELEMETRY.failed(replica, "failed", routed.request_id)
                message = "the replica serving this request stopped; try again"
                return _error(request.scope, 503, message, "replica_unavailable")
            head = held[0]
            return StreamingResponse(
                _rest(held[1:], stream, routed, head, request.scope), status_code=head["status"], headers=_headers(head)
            )

    def routing_events(self, request):
        """The latest routing decisions (`?limit=N`, default 100): every tenant's, so with keys the admin key's."""
        from ..server.guards import bearer, matching_key

        cfg = self.config
        if cfg.api_keys or cfg.admin_api_key:
            key = matching_key(bearer(request.scope), cfg)
            if key is None or key != cfg.admin_api_key:
                status, message, code = (
                    (401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'", "invalid_api_key")
                    if key is None
                    else (403, "routing events need the admin API key", "admin_key_required")
                )
                return _error(request.scope, status, message, code, "invalid_request_error")
        try:
            limit = int(request.query_params.get("limit", 100))
        except ValueError:
            limit = 100
        return JSONResponse({"events": TELEMETRY.events(limit)})

    async def every_cache(self, request):
        """/v1/cache (GET, DELETE) and /v1/cache/events over every replica: figures summed (each replica's
        under `replicas`), events merged in time order with their replica. A refusal (auth) is a replica's."""
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in request.scope["headers"]]
        query = request.scope.get("query_string", b"").decode("latin-1")
        answers = {}
        for rid in await self.replicas():
            req = HTTPRequest(request.method, request.url.path, query, headers, b"")
            try:
                items = [
                    c
                    async for c in self.engine.options(stream=True).forward.remote(
                        Routed(uuid.uuid4().hex, target=rid), req
                    )
                ]
            except Exception:  # a replica that died meanwhile has no cache left to report
                continue
            answers[rid] = items
        if not answers:
            return _error(request.scope, 503, "no replica is running", "replica_unavailable")
        for items in answers.values():
            if items[0]["status"] != 200:
                return _response(items)
        bodies = {rid: json.loads(b"".join(items[1:])) for rid, items in answers.items()}
        if request.url.path == "/v1/cache/events":
            events = sorted(
                ({**e, "replica": rid} for rid, b in bodies.items() for e in b["events"]), key=lambda e: e.get("ts", 0)
            )
            limit = (
                int(request.query_params.get("limit", 100)) if request.query_params.get("limit", "").isdigit() else 100
            )
            return JSONResponse({"events": events[-limit:] if limit > 0 else []})
        return JSONResponse({**_summed(list(bodies.values())), "replicas": bodies})

    async def replicas(self) -> list[str]:
        """The engine replicas' ids. This process's router learns them with its first request: before
        any, one /health request is sent."""
        if not replica_ids():
            try:
                [
                    _
                    async for _ in self.engine.options(stream=True).forward.remote(
                        Routed(uuid.uuid4().hex), HTTPRequest("GET", "/health", "", [], b"")
                    )
                ]
            except Exception as exc:
                log.warning("no replica answered: %s: %s", type(exc).__name__, exc)
        return replica_ids()

    async def metrics(self) -> bytes:
        """This process's routing metrics, then each replica's exposition, labelled with its replica id."""
        texts = {}
        for rid in await self.replicas():
            req = HTTPRequest("GET", "/metrics", "", [], b"")
            try:
                chunks = [
                    c
                    async for c in self.engine.options(stream=True).forward.remote(
                        Routed(uuid.uuid4().hex, target=rid), req
                    )
                ]
            except Exception:
                continue
            texts[rid] = b"".join(c for c in chunks if isinstance(c, bytes)).decode()
        return b"".join([generate_latest(TELEMETRY.registry), _merged(texts)])


async def _capped_body(request, limit: int) -> bytes | None:
    """The request's body, or None as soon as it is over `limit` bytes, declared or streamed (chunked): the rest
    is never read, so a client cannot make the routing process hold more than a replica would."""
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        return None
    chunks, seen = [], 0
    async for chunk in request.stream():
        seen += len(chunk)
        if seen > limit:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


def _summed(stats: list[dict]) -> dict:
    """Cache figures of several replicas as one: numbers added (booleans: any), nested figures alike,
    the hit rate recomputed."""
    out: dict = {}
    for key in stats[0]:
        values = [s[key] for s in stats if key in s]
        if isinstance(values[0], dict):
            out[key] = _summed(values)
        elif isinstance(values[0], bool):
            out[key] = any(values)
        elif isinstance(values[0], (int, float)):
            out[key] = sum(values)
        else:
            out[key] = values[0]
    if "lookups" in out and "hits" in out:
        out["hit_rate"] = out["hits"] / out["lookups"] if out["lookups"] else 0.0
    return out


def _messages(path: str, body: bytes) -> list:
    try:
        data = json.loads(body)
    except Exception:
        return []
    if not isinstance(data, dict):
        return []
    if path == "/v1/chat/completions" and isinstance(data.get("messages"), list):
        return data["messages"]
    if isinstance(data.get("prompt"), str):
        return [data["prompt"]]
    return []


_DROP = {"content-length", "transfer-encoding"}


def _headers(head: dict) -> dict:
    return {k: v for k, v in head["headers"] if k.lower() not in _DROP}


def _response(held: list):
    head = held[0]
    body = b"".join(held[1:])
    resp = Response(body, status_code=head["status"])
    resp.raw_headers = [
        (k.encode("latin-1"), v.encode("latin-1")) for k, v in head["headers"] if k.lower() != "content-length"
    ] + [(b"content-length", str(len(body)).encode())]
    return resp


async def _rest(held: list, stream, routed: Routed, head: dict, scope):
    for chunk in held:
        yield chunk
    try:
        async for chunk in stream:
            yield chunk
    except Exception as exc:
        if not _died(exc):
            raise
        TELEMETRY.failed(PLACED.pop(routed.request_id, ""), "failed", routed.request_id)
        if "text/event-stream" in dict((k.lower(), v) for k, v in head["headers"]).get("content-type", ""):
            message = "the replica serving this request stopped"
            yield _route_errors().of(scope).stream_error(503, message, "replica_unavailable")


def _merged(expositions: dict[str, str]) -> bytes:
    """Every replica's Prometheus text as one exposition, each sample labelled with its replica id."""
    from prometheus_client.parser import text_string_to_metric_families

    families: dict[str, Any] = {}
    for replica, text in expositions.items():
        for fam in text_string_to_metric_families(text):
            merged = families.setdefault(fam.name, copy.copy(fam))
            if merged is fam or merged.samples is fam.samples:
                merged.samples = []
            merged.samples += [s._replace(labels={"replica": replica, **s.labels}) for s in fam.samples]

    class Collected:
        def collect(self):
            return iter(families.values())

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Collected())
    return generate_latest(registry)


# -- the application ------------------------------------------------------------------------------------
def build_app(
    config: ServiceConfig,
    replicas: int,
    replica_cpus: float = 1.0,
    threads: int = 1,
    router: str = ROUTER,
    router_kwargs: dict | None = None,
    stats_period: float = 1.0,
    ingress_cpus: float = 0.0,
    prefill_tokens_per_s: float = 1000.0,
    transfer_bytes_per_s: float = 500e6,
):
    """The Serve application: `replicas` engine replicas behind one ingress. `router`: the request router
    class (import path) of the engine deployment: hyserve's by default (the benchmark compares others).
    A replica fetches a checkpoint from another rather than prefilling its tokens when its bytes at
    `transfer_bytes_per_s` take less time than its tokens at `prefill_tokens_per_s`. The ingress reserves no CPU by
    default: it only routes, and N replicas of one CPU each must fit on an N-CPU machine."""
    max_ongoing = config.max_running + config.max_waiting + 2  # the engine's own queue answers 429 first
    engine = serve.deployment(
        EngineReplica,
        name="engine",
        num_replicas=replicas,
        max_ongoing_requests=max_ongoing,
        ray_actor_options={"num_cpus": replica_cpus},
        request_router_config=RequestRouterConfig(
            request_router_class=router,
            request_router_kwargs=router_kwargs or {},
            request_routing_stats_period_s=stats_period,
        ),
        health_check_period_s=5,
        graceful_shutdown_timeout_s=5,
    ).bind(config, threads, prefill_tokens_per_s, transfer_bytes_per_s)

    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)

    @serve.deployment(name="ingress", max_ongoing_requests=1000, ray_actor_options={"num_cpus": ingress_cpus})
    @serve.ingress(app)
    class HTTPIngress(Ingress):
        @app.api_route("/{path:path}", methods=["GET", "POST", "DELETE", "PUT", "PATCH"])
        async def any_route(self, request: Request, path: str):
            return await self.handle(request)

    return HTTPIngress.bind(engine, config)

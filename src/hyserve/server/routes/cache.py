"""The prefix cache's admin routes: its figures, its latest events and clearing it. They act on the caller's
own tenant; the admin key (or a server without keys) acts on every tenant's (`guards.cache_scope`)."""

from __future__ import annotations

from fastapi import Depends, Request
from starlette.concurrency import run_in_threadpool

from ..errors import OPENAI
from ..guards import cache_scope
from ..serving import Serving, serving_of
from . import api_router

router = api_router(OPENAI)


def under_lock(serving: Serving, fn, *args):
    """`fn(*args)` off the event loop, under the runtime lock: the engine changes the tree while it runs."""

    def call():
        with serving.runtime.lock:
            return fn(*args)

    return run_in_threadpool(call)


@router.get("/v1/cache")
async def cache_stats(request: Request, serving: Serving = Depends(serving_of)):
    tenant = cache_scope(request.scope, serving.config)
    return await under_lock(
        serving, serving.service.cache.stats, tenant
    )  # (a clear's dead checkpoints are walked past)


@router.get("/v1/cache/events")
async def cache_events(request: Request, limit: int = 100, serving: Serving = Depends(serving_of)):
    return {"events": serving.service.cache.telemetry.events(cache_scope(request.scope, serving.config), limit)}


@router.delete("/v1/cache")
async def cache_clear(request: Request, serving: Serving = Depends(serving_of)):
    tenant = cache_scope(request.scope, serving.config)
    removed = await under_lock(serving, serving.service.engine.clear_cache, tenant)
    return {"cleared": removed, **(await under_lock(serving, serving.service.cache.stats, tenant))}

"""The served model and the server's probes: `/v1/models`, `/health` (for load balancers and orchestrators)
and `/metrics` (Prometheus)."""

from __future__ import annotations

from fastapi import Depends
from fastapi.responses import JSONResponse, Response

from ..errors import OPENAI
from ..serving import Serving, serving_of
from . import api_router

router = api_router(OPENAI)


def model_object(serving: Serving) -> dict:
    return {
        "id": serving.model_name,
        "object": "model",
        "created": serving.created,
        "owned_by": "hyserve",
        "max_model_len": serving.runtime.max_model_len,
    }


@router.get("/v1/models")
async def models(serving: Serving = Depends(serving_of)):
    return {"object": "list", "data": [model_object(serving)]}


@router.get("/v1/models/{model:path}")  # (ids such as "Qwen/Qwen3.5-4B" hold a slash)
async def model(model: str, serving: Serving = Depends(serving_of)):
    serving.check_model(model)
    return model_object(serving)


@router.get("/health")
async def health(serving: Serving = Depends(serving_of)):
    service = serving.service
    # The service exists only once the model is loaded; while draining, load balancers should stop.
    if service.draining:
        return JSONResponse({"status": "draining", "model": service.model_name}, status_code=503)
    # degraded: the engine's steps keep failing or one has hung; an orchestrator should restart it
    problem = service.engine.problem()
    if problem is not None:
        return JSONResponse(
            {"status": "degraded", "model": service.model_name, "idle": service.engine.idle, "reason": problem},
            status_code=503,
        )
    # idle: nothing queued, running or left for idle time (benchmarks wait for it between turns)
    # kernels: each of hyserve's kernels "on", or "off: why" (the load-time check against transformers)
    return {
        "status": "ok",
        "model": service.model_name,
        "idle": service.engine.idle,
        "kernels": serving.runtime.kernels.status,
    }


@router.get("/metrics")
async def prometheus(serving: Serving = Depends(serving_of)):
    return Response(serving.metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")

"""The OpenAI- and Anthropic-compatible HTTP app: the routers of every API surface (`routes/`) around one
`Serving`, behind the guards and the access log, with errors in each API's shape. It validates, renders
prompts and formats responses; the engine does everything that touches the model."""

from __future__ import annotations

from fastapi import FastAPI

from ..service import Service
from .access import AccessLogMiddleware
from .errors import RouteErrors, install_handlers
from .guards import GuardMiddleware
from .openapi_doc import install_openapi
from .routes import cache, chat, completions, messages, models, responses, tokens
from .serving import Serving

ROUTERS = (chat, completions, tokens, models, cache, responses, messages)  # (the order of the OpenAPI document)


def route_errors() -> RouteErrors:
    """Which error shape each route answers in (the Ray ingress, which answers for the replicas, reads it too)."""
    return RouteErrors(route for surface in ROUTERS for route in surface.router.routes)


def create_app(service: Service) -> FastAPI:
    app = FastAPI(title="hyserve", docs_url=None, redoc_url=None)
    app.state.serving = Serving(service)
    for surface in ROUTERS:
        app.include_router(surface.router)
    app.state.route_errors = errors = route_errors()
    install_handlers(app, errors)
    install_openapi(app)
    app.add_middleware(GuardMiddleware, service=service, route_errors=errors)
    app.add_middleware(AccessLogMiddleware)  # added last: outermost, it logs the guards' refusals too
    return app

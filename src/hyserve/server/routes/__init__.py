"""One FastAPI router per API surface; `app.create_app` includes them all. Each route reads the app's
`Serving` (`serving.serving_of`), checks and renders the request, and leaves the model to the engine.
(`functools.cache` is not imported by name here: `cache` is one of the router modules.)"""

import functools

from fastapi import APIRouter

from ..errors import ErrorFormat
from ..strict_json import StrictJSONRoute


@functools.cache
def route_class(errors: ErrorFormat) -> type[StrictJSONRoute]:
    """The route class of a surface: its routes carry `errors`, which `errors.RouteErrors` reads (a class,
    so that it holds however FastAPI includes the route)."""
    return type(f"{type(errors).__name__}Route", (StrictJSONRoute,), {"errors": errors})


def api_router(errors: ErrorFormat) -> APIRouter:
    """A router whose routes answer errors in `errors`' shape and refuse bodies holding a lone UTF-16
    surrogate (`strict_json`)."""
    return APIRouter(route_class=route_class(errors))

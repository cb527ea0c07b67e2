"""One FastAPI router per API surface; `app.create_app` includes them all. Each route reads the app's
`Serving` (`serving.serving_of`), checks and renders the request, and leaves the model to the engine."""

from fastapi import APIRouter

from ..strict_json import StrictJSONRoute


def api_router() -> APIRouter:
    """A router whose routes refuse bodies holding a lone UTF-16 surrogate (`strict_json`)."""
    return APIRouter(route_class=StrictJSONRoute)

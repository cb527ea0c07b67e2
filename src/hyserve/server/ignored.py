"""Fields a request body has that this server does not know are ignored, as in vLLM (so clients written for
other servers work), but never silently: a warning log line names them and so does the response's
`X-Hyserve-Ignored-Fields` header, so that a misspelt field (`max_token`) is found, not guessed at."""

from __future__ import annotations

import json
import logging

from pydantic import BaseModel

HEADER = "X-Hyserve-Ignored-Fields"
MAX_NAMED = 32  # a body with thousands of unknown keys gets a bounded header
log = logging.getLogger("hyserve.http")


def _safe(name: str) -> str:
    """A client's key as printable ASCII: no control character or newline reaches a header or a log line."""
    return json.dumps(name)[1:-1]


def ignored_fields(body: BaseModel) -> list[str]:
    """The body's top-level fields its model does not declare (pydantic keeps them in `model_extra`)."""
    return sorted(_safe(k) for k in body.model_extra or {})


def ignored_headers(body: BaseModel, endpoint: str) -> dict[str, str]:
    """The header naming the body's ignored fields (none: no header), after logging them."""
    names = ignored_fields(body)
    if not names:
        return {}
    shown = ", ".join(names[:MAX_NAMED]) + (f", ... ({len(names) - MAX_NAMED} more)" if len(names) > MAX_NAMED else "")
    log.warning("The following fields were present in the %s request but ignored: %s", endpoint, shown)
    return {HEADER: shown}

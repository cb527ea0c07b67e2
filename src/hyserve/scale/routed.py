"""What the ingress hands the request router with each request, and the routing process's own state (its
telemetry, its routers). Apart from the router class's module, which Ray Serve pickles by value to ship
it to every handle: objects here are shared by reference within a process."""

from __future__ import annotations

import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from .router import RoutingTelemetry

TELEMETRY = RoutingTelemetry()  # this process's routing decisions (the ingress's: its handle routes)
ROUTERS: weakref.WeakSet = weakref.WeakSet()  # the request routers living in this process
PLACED: OrderedDict[str, str] = OrderedDict()  # request id -> the replica it was last sent to (latest 10k)


def placed(request_id: str, replica: str) -> None:
    PLACED[request_id] = replica
    PLACED.move_to_end(request_id)
    while len(PLACED) > 10_000:
        PLACED.popitem(last=False)


def replica_ids() -> list[str]:
    """Replicas the routers of this process know."""
    return sorted({r for router in list(ROUTERS) for r in router.replica_ids()})


@dataclass
class Routed:
    """The first argument of every call to a replica: what the request router reads."""

    request_id: str
    salt: str = ""
    tokens: list[int] | None = None
    # the prompt as text, for Ray Serve LLM's PrefixCacheAffinityRouter (benchmarks compare against it)
    messages: list[Any] = field(default_factory=list)
    target: str | None = None  # a replica id: this replica only (the ingress's fan-out to every replica)
    avoid: str | None = None  # a replica id not to use (it just died under this request)
    # set by the router when it sends the request away from the replica holding its deepest checkpoint:
    # that replica, and the checkpoint's length (the chosen replica may fetch it: `transfer`)
    fetch_from: str | None = None
    fetch_tokens: int = 0

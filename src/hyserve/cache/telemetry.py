"""One structured event per cache decision: to Prometheus, to a JSON-lines file, and to a ring buffer.

An event of a known request carries its tenant, so a tenant can be shown its own events only."""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict, deque
from pathlib import Path

from ..metrics import Metrics

EVENTS = ("recorded", "deferred", "declined", "skipped", "hit", "miss", "evicted", "cleared", "spilled", "loaded")


class CacheTelemetry:
    def __init__(self, metrics: Metrics, log_path: str | Path | None = None, keep: int = 2000):
        self.metrics = metrics
        self.recent: deque[dict] = deque(maxlen=keep)
        self._file = open(log_path, "a", buffering=1) if log_path else None
        self._lock = threading.Lock()
        self._tenants: OrderedDict[str, str] = OrderedDict()  # request id -> tenant, the latest `keep`
        self._keep = keep

    def bind(self, request_id: str, tenant: str) -> None:
        """Stamp `tenant` on the events of `request_id` (the engine emits them with the request id only)."""
        with self._lock:
            self._tenants[request_id] = tenant
            while len(self._tenants) > self._keep:
                self._tenants.popitem(last=False)

    def emit(self, event: str, reason: str = "", tenant: str | None = None, **fields) -> dict:
        assert event in EVENTS, event
        record = {"ts": round(time.time(), 6), "event": event, "reason": reason, **fields}
        # the metric's label is the reason without its token position ("history:not_a_prefix@12"): that stays
        # in the event
        self.metrics.cache_events.labels(event, reason.split("@")[0]).inc()
        with self._lock:
            if tenant is None and "request_id" in fields:
                tenant = self._tenants.get(fields["request_id"])
            if tenant is not None:
                record["tenant"] = tenant
            self.recent.append(record)
            if self._file is not None:
                self._file.write(json.dumps(record) + "\n")
        return record

    def events(self, tenant: str | None = None, limit: int = 100) -> list[dict]:
        """The latest `limit` events: all of them, or those stamped with `tenant`."""
        with self._lock:
            recent = list(self.recent)
        if tenant is not None:
            recent = [e for e in recent if e.get("tenant") == tenant]
        return recent[-limit:] if limit > 0 else []

    def close(self) -> None:
        if self._file is not None:
            self._file.close()

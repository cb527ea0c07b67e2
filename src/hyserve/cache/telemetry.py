"""One structured event per cache decision: to Prometheus, to a JSON-lines file, and to a ring buffer."""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from pathlib import Path

from ..metrics import Metrics

EVENTS = ("recorded", "deferred", "declined", "skipped", "hit", "miss", "evicted", "cleared")


class CacheTelemetry:
    def __init__(self, metrics: Metrics, log_path: str | Path | None = None, keep: int = 2000):
        self.metrics = metrics
        self.recent: deque[dict] = deque(maxlen=keep)
        self._file = open(log_path, "a", buffering=1) if log_path else None
        self._lock = threading.Lock()

    def emit(self, event: str, reason: str = "", **fields) -> dict:
        assert event in EVENTS, event
        record = {"ts": round(time.time(), 6), "event": event, "reason": reason, **fields}
        self.metrics.cache_events.labels(event, reason.split(":")[0]).inc()
        with self._lock:
            self.recent.append(record)
            if self._file is not None:
                self._file.write(json.dumps(record) + "\n")
        return record

    def close(self) -> None:
        if self._file is not None:
            self._file.close()

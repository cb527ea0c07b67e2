"""Logging for the command line: one handler on stderr, plain text or JSON lines, and the access line.

Text lines read like uvicorn's and vLLM's (`2026-05-06 12:00:01 INFO hyserve.access: ...`); with
`--log-format json` every line is one JSON object, so log shippers need no parsing rules. A record's
structured fields (the access line's tokens and timings, the engine line's throughput) travel in
`extra={"fields": {...}}`: the text format writes them as `key=value` in the message, JSON as keys.
"""

from __future__ import annotations

import json
import logging
import sys
import time

LEVELS = ("debug", "info", "warning", "error")
FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

access_log = logging.getLogger("hyserve.access")
# Probes a load balancer polls every few seconds: their lines are DEBUG, so INFO shows requests only
QUIET_PATHS = ("/health", "/metrics")


class JSONFormatter(logging.Formatter):
    """One JSON object per record: time, level, logger, message, the record's fields, any traceback."""

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S")
            + f".{int(record.msecs):03d}"
            + time.strftime("%z", self.converter(record.created)),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        out.update(getattr(record, "fields", None) or {})
        if record.exc_info:
            out["exc_info"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False, default=str)


class _UvicornName(logging.Filter):
    """uvicorn's general logger is named `uvicorn.error` for history's sake; its INFO lines are no errors."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name == "uvicorn.error":
            record.name = "uvicorn"
        return True


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def human_count(n: float) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return f"{n:.0f}"


class _StderrHandler(logging.StreamHandler):
    """A handler on whatever `sys.stderr` is when a record is written, not when it was set up: a process that
    swaps stderr (pytest's capture, a daemonizing wrapper) never has records written to a closed stream."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value):
        pass


def configure(level: str = "info", fmt: str = "text", stream=None) -> None:
    """Route hyserve's and uvicorn's loggers to one stderr handler at `level`; other libraries' records
    still show from WARNING up, so a debug run is hyserve's debug lines, not every dependency's."""
    handler = logging.StreamHandler(stream) if stream is not None else _StderrHandler()
    handler.setFormatter(JSONFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT, "%Y-%m-%d %H:%M:%S"))
    handler.addFilter(_UvicornName())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    numeric = getattr(logging, level.upper())
    root.setLevel(max(numeric, logging.WARNING))
    for name in ("hyserve", "uvicorn", "uvicorn.error"):
        logger = logging.getLogger(name)
        logger.setLevel(numeric)
        logger.handlers.clear()
        logger.propagate = True
    # hyserve writes its own access line (with tokens and timings); uvicorn's would repeat it without them
    logging.getLogger("uvicorn.access").disabled = True
    logging.captureWarnings(True)


def text_fields(fields: dict) -> str:
    """`key=value` pairs, in order, for the text format; None shows as `-`."""
    return " ".join(f"{k}={'-' if v is None else v}" for k, v in fields.items())


def log_access(client: str, method: str, path: str, http_version: str, status: int, fields: dict) -> None:
    """One line per finished HTTP request: uvicorn's `client - "METHOD path HTTP/v" status`, then the
    request's id, tokens (prompt, of those cached, generated), time to first token, decode speed, why it
    finished and its whole duration."""
    level = logging.DEBUG if path in QUIET_PATHS else logging.INFO
    if not access_log.isEnabledFor(level):
        return
    line = f'{client} - "{method} {path} HTTP/{http_version}" {"-" if status is None else status}'
    shown = text_fields({k: v for k, v in fields.items() if v is not None})
    access_log.log(
        level,
        "%s",
        f"{line} {shown}" if shown else line,
        extra={"fields": {"client": client, "method": method, "path": path, "status": status, **fields}},
    )

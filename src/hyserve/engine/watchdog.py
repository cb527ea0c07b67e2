"""The watchdog: notices when the engine's steps stop making progress, and says so.

Every phase's work on one request runs in that request's own guard, so a step that raises anyway has a bug
outside them (or a fault in the machine). The worker counts steps that raise in a row; at `max_failures` it
fails every request the step involves and starts again from an empty running list (`Engine._recover`).
A step that hangs (a forward pass that never returns) cannot be interrupted from Python: after
`stall_after` seconds the watchdog's own thread ends the requests the step holds with a `Failed` item, so
their clients are answered, and marks them cancelled, so the step releases them if it ever returns; requests
that wait behind the hung step are failed too, as they arrive.

`problem()` is what `/health` reports: None while steps succeed, else why the engine is degraded (an
orchestrator restarts an engine that stays so).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class Watchdog:
    def __init__(self, stall_after: float = 60.0, max_failures: int = 3):
        self.stall_after = stall_after
        self.max_failures = max_failures
        self.failures = 0  # steps in a row that raised
        self.started: float | None = None  # when the step in progress started (monotonic)
        self._stop = threading.Event()

    # -- the worker reports each step ------------------------------------------------------
    def begin(self) -> None:
        self.started = time.monotonic()

    def succeeded(self) -> None:
        self.started, self.failures = None, 0

    def failed(self) -> bool:
        """A step raised; True when that makes `max_failures` in a row (the worker then recovers)."""
        self.started = None
        self.failures += 1
        return self.failures % self.max_failures == 0

    # -- what is wrong ---------------------------------------------------------------------
    def stalled_for(self) -> float:
        """Seconds the step in progress has run beyond `stall_after` (0: none has)."""
        started = self.started
        if started is None:
            return 0.0
        return max(0.0, time.monotonic() - started - self.stall_after)

    def problem(self, busy: bool) -> str | None:
        """Why the engine is not making progress, or None. `busy`: requests are waiting or running."""
        if not busy:  # nothing is waiting for the engine (an idle-time job may take its time)
            return None
        started = self.started
        if started is not None and time.monotonic() - started > self.stall_after:
            return f"an engine step has run for {time.monotonic() - started:.1f} s"
        if self.failures:
            return f"{self.failures} engine step(s) in a row failed"
        return None

    # -- the watching thread ---------------------------------------------------------------
    def watch(self, on_stall: Callable[[], None]) -> threading.Thread:
        """Start a thread that calls `on_stall()` every tick (a quarter of `stall_after`, at most 1 s) while
        the step in progress has run longer than `stall_after`."""

        def loop() -> None:
            while not self._stop.wait(min(1.0, max(0.02, self.stall_after / 4))):
                if self.stalled_for() > 0:
                    on_stall()

        thread = threading.Thread(target=loop, name="hyserve-watchdog", daemon=True)
        thread.start()
        return thread

    def stop(self) -> None:
        self._stop.set()

"""Admission and ordering: a bounded waiting queue, at most `max_running` requests with live states.

Each engine step runs about one prefill chunk's worth of prompt tokens (first come, first served;
short prompts share it) and one batched decode token for every request past prefill, so a long new
prompt delays other streams by one chunk, not its length.
"""

from __future__ import annotations

import threading
from collections import deque


class QueueFull(Exception):
    """The waiting queue is at its bound: the server answers 429."""


class Scheduler:
    def __init__(self, max_running: int = 8, max_waiting: int = 64):
        self.max_running = max_running
        self.max_waiting = max_waiting
        self.waiting: deque = deque()
        self.running: list = []
        self.background: deque = deque()  # jobs (re-rendered histories, deferred checkpoints), newest last
        self.cond = threading.Condition()

    def add(self, item) -> None:
        with self.cond:
            if len(self.waiting) >= self.max_waiting:
                raise QueueFull(f"server is at capacity ({self.max_running} running, {self.max_waiting} waiting)")
            self.waiting.append(item)
            self.cond.notify()

    def wait_for_work(self, timeout: float = 0.5, pending: bool = False) -> None:
        """Until there is a request or a job (`pending`: one the caller holds outside the queue)."""
        with self.cond:
            if not self.waiting and not self.running and not self.background and not pending:
                self.cond.wait(timeout)

    def admit(self) -> list:
        """Move waiting requests into free running slots; returns the newly admitted ones."""
        admitted = []
        with self.cond:
            while self.waiting and len(self.running) < self.max_running:
                item = self.waiting.popleft()
                self.running.append(item)
                admitted.append(item)
        return admitted

    def take_waiting(self, pred) -> list:
        """Remove and return waiting items matching `pred` (cancelled before they started)."""
        return self._take(self.waiting, pred)

    def _take(self, queue: deque, pred) -> list:
        with self.cond:
            taken = [item for item in queue if pred(item)]
            for item in taken:
                queue.remove(item)
        return taken

    def remove(self, item) -> None:
        with self.cond:
            if item in self.running:
                self.running.remove(item)

    def add_background(self, job, limit: int = 64) -> None:
        with self.cond:
            self.background.append(job)
            while len(self.background) > limit:
                self.background.popleft()
            self.cond.notify()

    def take_background(self, pred) -> list:
        """Remove and return the background jobs matching `pred`."""
        return self._take(self.background, pred)

    @property
    def busy(self) -> bool:
        """Requests are queued or running: background work must wait."""
        return bool(self.waiting or self.running)

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running and not self.background

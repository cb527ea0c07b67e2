"""Delivery of `stream` items from the model thread to the consumers' event loops.

Items are collected and delivered in one wake-up per event loop (`flush`): a wake-up per token per request
costs the model thread time with every stream (docs/design.md, "Figures behind some constants"). The
engine flushes before each forward pass that follows emits and at the end of every step.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator

from .api import Emit, Failed, Finished, GenerationRequest

# Longest the model thread waits, after emitting streams' first tokens, for their event loops to take them
FIRST_TOKEN_HANDOFF = 0.002  # seconds


def _deliver(pairs: list[tuple[asyncio.Queue, object]]) -> None:
    for queue, item in pairs:
        queue.put_nowait(item)


class Outbox:
    def __init__(self):
        # (loop, queue, item, the stream's `taken` event while its first item is on the way, else None)
        self.items: list[tuple[asyncio.AbstractEventLoop, asyncio.Queue, object, threading.Event | None]] = []
        self.lock = threading.Lock()  # the watchdog's thread emits and flushes too

    def open(self, req: GenerationRequest) -> tuple[Emit, AsyncIterator[object]]:
        """An `emit` for the engine and the async iterator its consumer reads (in the running event loop)."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        taken = threading.Event()  # set once the consumer has handled the first item and asks for the next

        def emit(item) -> None:
            with self.lock:
                self.items.append((loop, queue, item, None if taken.is_set() else taken))

        return emit, _drain(req, queue, taken)

    def flush(self) -> None:
        """Deliver the items emitted since the last flush: one call per event loop."""
        if not self.items:
            return
        with self.lock:
            box, self.items = self.items, []
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        firsts = []
        for loop, queue, item, taken in box:
            by_loop.setdefault(loop, []).append((queue, item))
            if taken is not None:
                firsts.append(taken)
        for loop, pairs in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, pairs)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                pass
        # A stream's first token: let its event loop write it before the next pass takes the GIL back.
        # Otherwise the loop thread waits on a model thread that releases the GIL only briefly, inside
        # each op, and the first chunk left up to a switch interval (5 ms) later.
        deadline = time.perf_counter() + FIRST_TOKEN_HANDOFF
        for taken in firsts:
            taken.wait(max(0.0, deadline - time.perf_counter()))


async def _drain(req: GenerationRequest, items: asyncio.Queue, taken: threading.Event) -> AsyncIterator[object]:
    try:
        while True:
            item = await items.get()
            yield item
            if not taken.is_set():  # once: Event.set takes a lock, and this runs for every token
                taken.set()
            if isinstance(item, (Finished, Failed)):
                return
    finally:
        taken.set()
        req.cancelled.set()

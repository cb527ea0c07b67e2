"""`n` > 1: n generation requests for one prompt, prefilled once (the engine's `prefill_from`), each with
its own seed, and their item streams merged into one, tagged with the choice's index."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import AsyncIterator

from ..engine import GenerationRequest

SEED_SPAN = 2**64  # seeds live in [-(2**63), 2**64 - 1] (what torch.Generator.manual_seed accepts)


def siblings(req: GenerationRequest, n: int) -> list[GenerationRequest]:
    """`req` and n - 1 copies that decode from its prefilled state. Choice i samples with seed + i, so a
    seeded request gives the same n choices every time; unseeded, each draws its own."""
    out = [req]
    for i in range(1, n):
        seed = req.sampling.seed
        if seed is not None:
            seed = seed + i if seed + i < SEED_SPAN else seed + i - SEED_SPAN
        out.append(
            dataclasses.replace(
                req,
                sampling=dataclasses.replace(req.sampling, seed=seed),
                prefill_from=req,
                request_id=f"{req.request_id}-{i}",
                cancelled=threading.Event(),
            )
        )
    return out


async def merged(streams: list[AsyncIterator[object]]) -> AsyncIterator[tuple[int, object]]:
    """(choice index, item) from every stream as they come; leaving early closes them all."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, stream) -> None:
        try:
            async for item in stream:
                queue.put_nowait((i, item))
        finally:
            queue.put_nowait((i, done))
            await stream.aclose()

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(streams)
        while left:
            i, item = await queue.get()
            if item is done:
                left -= 1
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()

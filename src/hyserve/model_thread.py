"""One thread per process runs every PyTorch operation on the model.

PyTorch's CPU kernels use OpenMP (libgomp), which keeps a pool of worker threads per calling thread
and lets them spin briefly between parallel regions. A thread that starts its pool while another
thread's pool exists (together they outnumber the cores) gets one that barely spins, so every one of
the hundreds of small parallel regions in a forward pass pays a sleep and a wake-up. `benchmarks/bench_threads.py`
measures a warm prefill on the first torch thread and on a second one. With one engine thread per service, the
second service in a process (a benchmark's cache-off server, a test's second fixture) ran much slower. So
engines, and benchmarks that time a bare forward pass, hand their model work to this one thread.

The thread also flushes denormal floats to zero (x86 FTZ/DAZ) before its first PyTorch operation. The
flag is per thread and OpenMP workers copy it from the thread that creates them, so it must be set
before the pool exists. Gated DeltaNet prefill produces denormals (decays exp(-large)), and each one
costs a slow micro-coded path: `benchmarks/bench_kernels.py` measures what flushing buys (a cold 4.1k-token
prefill and a 79-token warm one). Values below 1.2e-38 become 0, far below float32 rounding
of any logit. `HYSERVE_FLUSH_DENORMAL=0` turns it off.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

T = TypeVar("T")

_jobs: queue.SimpleQueue[tuple[Callable, tuple, dict, Future]] = queue.SimpleQueue()
_thread: threading.Thread | None = None
_start_lock = threading.Lock()


def flush_denormal_enabled() -> bool:
    return os.environ.get("HYSERVE_FLUSH_DENORMAL", "1") != "0"


def _serve() -> None:
    if flush_denormal_enabled():
        import torch

        torch.set_flush_denormal(True)  # before this thread's first parallel region creates its pool
    while True:
        fn, args, kwargs, fut = _jobs.get()
        if not fut.set_running_or_notify_cancel():
            continue
        try:
            fut.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # handed to the caller, who re-raises it
            fut.set_exception(exc)


def on_model_thread() -> bool:
    return _thread is not None and threading.current_thread() is _thread


def run(fn: Callable[..., T], *args, **kwargs) -> T:
    """Call `fn` on the model thread and return its result (or raise its exception); direct when
    already there, so nested calls cannot deadlock."""
    global _thread
    if on_model_thread():
        return fn(*args, **kwargs)
    with _start_lock:
        if _thread is None:
            _thread = threading.Thread(target=_serve, name="hyserve-model", daemon=True)
            _thread.start()
    fut: Future = Future()
    _jobs.put((fn, args, kwargs, fut))
    return fut.result()

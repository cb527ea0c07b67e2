"""Where a loaded server's memory goes: an in-process soak that counts it every few seconds.

`bench_load.py`'s soak reads the server process's RSS from outside. This one runs the same kind of load (S
sessions looping 4-turn chats of ~100-300-token user messages, 128-token greedy replies, a 512 MiB
prefix cache) on an engine in this process, without HTTP, so it can also count what the RSS is made of:

- `cache`: bytes of the prefix cache's snapshots (its own accounting);
- `live`: bytes of the running requests' states and the decode batch (`hyserve_live_state_bytes`);
- `tensors`: bytes of every CPU tensor storage the garbage collector can reach (weights, snapshots,
  live states, decode batch), each storage once;
- glibc's view (`mallinfo2`, all arenas): `heap` = bytes its heaps span, `in use` and `free` within
  them, and `mmapped` = blocks it mapped one by one (32 MiB and up). Snapshots are not in any of these:
  they are blocks mapped for themselves (`state.caches.packed_clones`);
- `trims`: the engine's hand-backs of free heap pages to the OS so far (`allocator.Trimmer`).

    python benchmarks/bench_memory.py                      # bench qwen3_5, 16 sessions, 240 s, a sample every 20 s
    python benchmarks/bench_memory.py --quick              # tiny qwen3_5, 4 sessions, 10 s (a smoke test)
    python benchmarks/bench_memory.py --json benchmarks/results/memory.json
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common as C  # noqa: E402
from bench_load import Conversation  # noqa: E402


def glibc_heap() -> dict | None:
    """glibc's own account of its allocations (all arenas), or None on another C library."""
    from hyserve.allocator import mallinfo2

    m = mallinfo2()
    if m is None:
        return None
    return {"heap": m.arena, "in_use": m.uordblks, "free": m.fordblks, "mmapped": m.hblkhd}


def tensor_bytes() -> int:
    """Bytes of every distinct CPU tensor storage reachable by the garbage collector."""
    import torch

    seen, total = set(), 0
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
            storage = obj.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
    return total


def rss_bytes() -> int:
    return C.pid_rss_bytes(os.getpid()) or 0


def census_table(rows: list[dict]) -> str:
    """One row per sample (the JSON's `rows`), in MiB."""
    mib = lambda b: "-" if b is None else f"{b / 2**20:.0f}"  # noqa: E731
    headers = [
        "s",
        "requests",
        "RSS MiB",
        "cache MiB",
        "live MiB",
        "tensors MiB",
        "RSS - tensors MiB",
        "heap MiB",
        "in use MiB",
        "free MiB",
        "mmapped MiB",
        "trims",
    ]
    return C.table(
        headers,
        [
            [
                f"{r['t']:.0f}",
                r["requests"],
                mib(r["rss"]),
                mib(r["cache"]),
                mib(r["live"]),
                mib(r["tensors"]),
                mib(r["rss"] - r["tensors"]),
                mib(r.get("heap")),
                mib(r.get("in_use")),
                mib(r.get("free")),
                mib(r.get("mmapped")),
                r["trims"],
            ]
            for r in rows
        ],
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny qwen3_5, 4 sessions, 10 s")
    p.add_argument("--seconds", type=float, default=None, help="load duration (default 240; quick 10)")
    p.add_argument("--every", type=float, default=None, help="seconds between samples (default 20; quick 2)")
    p.add_argument("--sessions", type=int, default=None, help="concurrent sessions (default 16; quick 4)")
    p.add_argument("--cache-mib", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", dest="json_out", default=None)
    args = p.parse_args(argv)
    seconds = args.seconds or (10.0 if args.quick else 240.0)
    every = args.every or (2.0 if args.quick else 20.0)
    sessions = args.sessions or (4 if args.quick else 16)
    C.setup_torch(args.threads)
    from hyserve.engine import GenerationRequest
    from hyserve.service import ServiceConfig, build_service

    model_dir = C.ensure_model("qwen3_5", "tiny" if args.quick else "bench")
    service = build_service(
        ServiceConfig(model_dir, device="cpu", cache_bytes=args.cache_mib << 20, max_running=sessions)
    )
    engine, tok = service.engine, service.runtime.tokenizer
    system = "You are a careful assistant. " + C.text_of_tokens(tok, random.Random(0), 60 if args.quick else 300)
    lo, hi = (20, 60) if args.quick else (100, 300)
    deadline = time.perf_counter() + seconds
    requests, failures = [0], []

    def session(i: int) -> None:
        k = 0
        while time.perf_counter() < deadline:
            conv = Conversation(tok, system, 4, 10_000_000 + i * 1000 + k, lo, hi)
            messages = [{"role": "system", "content": system}]
            for user in conv.users:
                messages.append({"role": "user", "content": user})
                try:
                    chat = engine.render_chat(messages)
                    done = engine.generate(
                        GenerationRequest(chat.prompt, args.max_tokens, messages=messages, chat=chat)
                    )
                except Exception as exc:  # counted, never retried
                    failures.append(f"{type(exc).__name__}: {exc}"[:200])
                    return
                requests[0] += 1
                messages.append({"role": "assistant", "content": done.text})
            k += 1

    def sample(t: float) -> dict:
        heap = glibc_heap() or {}
        live = service.metrics.registry.get_sample_value("hyserve_live_state_bytes")
        return {
            "t": t,
            "rss": rss_bytes(),
            "cache": service.cache.stats()["bytes"],
            "live": live,
            "tensors": tensor_bytes(),
            "requests": requests[0],
            "trims": _count(getattr(service.metrics, "malloc_trim", None)),
            **heap,
        }

    t0 = time.perf_counter()
    rows = [sample(0.0)]
    workers = [threading.Thread(target=session, args=(i,), daemon=True) for i in range(sessions)]
    for w in workers:
        w.start()
    while time.perf_counter() < deadline:
        time.sleep(max(0.0, min(every, deadline - time.perf_counter())))
        rows.append(sample(time.perf_counter() - t0))
    for w in workers:  # each finishes the request it is in
        w.join()
    gc.collect()
    rows.append(sample(time.perf_counter() - t0))  # the load is over: what stays
    engine.stop()

    table = census_table(rows)
    import hyserve

    print(f"hyserve from {Path(hyserve.__file__).parent}")
    print(
        f"{sessions} sessions for {seconds:.0f} s, {args.max_tokens}-token replies, cache {args.cache_mib} MiB; "
        f"{requests[0]} requests, {len(failures)} failures; last row: after the load, once every session ended"
    )
    print(table)
    if args.json_out:
        C.write_result(args.json_out, "bench_memory.py", {"rows": rows, "failures": failures, "table": table})
    return 1 if failures else 0


def _count(histogram) -> int:
    """Observations so far of a prometheus_client Histogram (0 without one: code from before the trims)."""
    if histogram is None:
        return 0
    return int(next(s.value for m in histogram.collect() for s in m.samples if s.name.endswith("_count")))


if __name__ == "__main__":
    sys.exit(main())

"""The disk tier (`--cache-dir`), on this machine: what it adds when memory holds only a few checkpoints,
and what a warm turn costs when its checkpoint comes from disk.

1. Many conversations taking turns round-robin with a memory budget of about two checkpoints: cached
   prompt tokens / prompt tokens and hits / lookups, memory only against memory + disk. The replies of the
   two runs must be equal token for token (the script stops otherwise).
2. A warm turn at ~4k tokens of history (restore, prefill the new message, argmax): its checkpoint in
   memory, on disk only (find, read, verify, restore), and no cache (prefill everything).

    python benchmarks/bench_disk.py                 # bench qwen3_5, 12 chats x 4 turns, 4k history
    python benchmarks/bench_disk.py --quick         # tiny qwen3_5, a smoke test
    python benchmarks/bench_disk.py --json benchmarks/results/disk.json
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common as C  # noqa: E402


def round_robin(service, chats: int, turns: int, words: int, seed: int = 0):
    """Replies and (prompt, cached) tokens of `chats` conversations taking `turns` turns each in turn."""
    from hyserve.engine import GenerationRequest
    from hyserve.engine.sampling import SamplingParams

    rng = random.Random(seed)
    history = [[{"role": "system", "content": f"You are assistant number {c}."}] for c in range(chats)]
    replies, prompt_tokens, cached_tokens = [], 0, 0
    for _ in range(turns):
        for c in range(chats):
            messages = history[c] + [{"role": "user", "content": C.prose(rng, words)}]
            prompt = service.runtime.render_chat(messages, True)
            fin = service.engine.generate(
                GenerationRequest(
                    prompt=prompt, max_tokens=8, messages=messages, sampling=SamplingParams(temperature=0.0)
                )
            )
            replies.append(fin.token_ids)
            prompt_tokens, cached_tokens = prompt_tokens + len(prompt), cached_tokens + fin.cached_tokens
            history[c] = messages + [{"role": "assistant", "content": fin.text}]
            while not service.engine.idle:  # a reader between turns: idle-time checkpoints are done
                time.sleep(0.005)
            if service.cache.disk is not None:
                service.cache.disk.flush()
    return replies, prompt_tokens, cached_tokens


def hit_rates(model_dir, chats: int, turns: int, words: int) -> list[dict]:
    from hyserve.service import ServiceConfig, build_service

    probe = build_service(ServiceConfig(model_dir=model_dir, device="cpu"))
    round_robin(probe, 1, 2, words)
    one = max(s.nbytes for _, s in probe.cache.tree.snapshots())
    probe.engine.stop()
    rows, replies = [], None
    for label in ("memory only", "memory + disk"):
        with tempfile.TemporaryDirectory() as tmp:
            svc = build_service(
                ServiceConfig(
                    model_dir=model_dir,
                    device="cpu",
                    cache_bytes=one * 5 // 2,
                    cache_dir=Path(tmp) if "disk" in label else None,
                )
            )
            got, prompt, cached = round_robin(svc, chats, turns, words)
            stats = svc.cache.stats()
            svc.engine.stop()
        if replies is not None and got != replies:
            sys.exit("replies differ between memory only and memory + disk: a correctness bug")
        replies = got
        rows.append(
            {
                "cache": label,
                "memory_budget_bytes": one * 5 // 2,
                "prompt_tokens": prompt,
                "cached_tokens": cached,
                "token_hit_rate": round(cached / prompt, 3),
                "lookups": stats["lookups"],
                "hits": stats["hits"],
                "disk_hits": stats["tiers"]["disk"].get("hits", 0),
            }
        )
    return rows


def warm_turns(model_dir, history_tokens: int, reps: int) -> list[dict]:
    import torch

    from hyserve.cache.disk import DiskTier
    from hyserve.cache.manager import PrefixCache
    from hyserve.cache.telemetry import CacheTelemetry
    from hyserve.metrics import Metrics
    from hyserve.models.runtime import ModelRuntime

    rt = ModelRuntime.load(model_dir, device="cpu")
    ad, rng = rt.adapter, random.Random(1)
    history = rt.encode(C.text_of_tokens(rt.tokenizer, rng, history_tokens))
    prompt = history + rt.encode(C.prose(rng, 20))
    state = ad.new_state()
    ad.forward(state, history)
    metrics = Metrics()
    with tempfile.TemporaryDirectory() as tmp:
        telemetry = CacheTelemetry(metrics)
        disk = DiskTier(tmp, 1 << 40, "bench", metrics, telemetry)
        cache = PrefixCache(1 << 40, metrics, telemetry, disk=disk)
        cache.record(ad, state, "history", len(history))
        disk.flush()

        def turn(where: str) -> float:
            if where == "disk":
                cache.tree.clear()  # memory forgets it: the lookup reads the file
            t0 = time.perf_counter()
            restored = cache.restore(ad, prompt) if where != "none" else None
            live = restored.state if restored is not None else ad.new_state()
            int(torch.argmax(ad.forward(live, prompt[live.position :])))
            seconds = time.perf_counter() - t0
            if restored is not None:
                assert restored.cached_tokens == len(history), (where, restored.cached_tokens)
                cache.release(restored)
            return seconds

        rows = []
        for where in ("memory", "disk", "none"):
            turn(where)  # warm-up
            rows.append(
                {
                    "checkpoint": where,
                    "history_tokens": len(history),
                    "new_tokens": len(prompt) - len(history),
                    "ttft_ms": C.median([turn(where) for _ in range(reps)]) * 1e3,
                }
            )
        rows[1]["file_bytes"] = disk.usage()[1]
        disk.close()
    return rows


def tables(result: dict) -> str:
    """The two tables, as docs/benchmarks.md shows them."""
    rates, warm = result["hit_rates"], result["warm_turns"]
    first = C.table(
        ["cache", "memory budget", "prompt tokens", "cached tokens", "token hit rate", "hits / lookups", "disk hits"],
        [
            [
                r["cache"],
                r["memory_budget_bytes"],
                r["prompt_tokens"],
                r["cached_tokens"],
                C.fmt_pct(r["token_hit_rate"]),
                f"{r['hits']} / {r['lookups']}",
                r["disk_hits"],
            ]
            for r in rates
        ],
    )
    second = C.table(
        ["checkpoint", "history tokens", "new tokens", "warm-turn TTFT ms"],
        [[r["checkpoint"], r["history_tokens"], r["new_tokens"], round(r["ttft_ms"], 2)] for r in warm],
    )
    return first + "\n\n" + second


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny qwen3_5, 3 chats x 3 turns, short history")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", dest="json_out", default=None)
    args = p.parse_args()
    C.setup_torch(args.threads)
    size = "tiny" if args.quick else "bench"
    model_dir = C.ensure_model("qwen3_5", size)
    rates = hit_rates(model_dir, *((3, 3, 20) if args.quick else (12, 4, 120)))
    warm = warm_turns(model_dir, 300 if args.quick else 4096, 3 if args.quick else 7)
    print(tables({"hit_rates": rates, "warm_turns": warm}))
    if args.json_out:
        C.write_result(args.json_out, "bench_disk.py", {"hit_rates": rates, "warm_turns": warm})


if __name__ == "__main__":
    main()

"""Attention KV stored once along the tree (`hyserve.state.kv_chain`) against a whole copy per checkpoint
(`--no-kv-sharing`), in one run on the same model.

1. One 8-turn conversation through the engine (system prompt, each history boundary, each reply: the
   checkpoints the engine takes), growing to ~8k tokens, once with KV sharing and once without. The replies
   must be equal token for token (the script stops otherwise). After it: the cache's bytes, in states and in
   KV segments.
2. Each checkpoint's cost: what it added to the cache with sharing (its state + the KV of the tokens since
   the checkpoint above it), what it holds alone (its state + all its KV: the cost without sharing), and the
   estimate (state bytes + KV bytes per token x new tokens). Also the time to take it (snapshot, which with
   sharing includes comparing the live KV with the chain above).
3. A warm turn on the grown conversation (restore from the deepest checkpoint, prefill a new message,
   argmax), sharing on and off: restore alone (a chain is concatenated once per layer; a whole copy is
   shared as it is) and the whole TTFT.

    python benchmarks/bench_kv_sharing.py                 # bench qwen3_5, 8 turns to ~8k tokens
    python benchmarks/bench_kv_sharing.py --quick         # tiny qwen3_5, a smoke test
    python benchmarks/bench_kv_sharing.py --json benchmarks/results/kv-sharing.json
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common as C  # noqa: E402

MODES = (("shared", True), ("whole", False))


def conversation(service, turns: int, user_tokens: int, reply_tokens: int, seed: int = 0) -> tuple[list, list]:
    """Replies and per-turn (prompt tokens, cached tokens) of one conversation; the engine is left idle
    between turns (a reader), so its idle-time checkpoints are taken."""
    from hyserve.engine import GenerationRequest
    from hyserve.engine.sampling import SamplingParams

    rng = random.Random(seed)
    tok = service.runtime.tokenizer
    messages = [{"role": "system", "content": "You are a helpful assistant. " + C.prose(rng, 40)}]
    replies, rows = [], []
    for _ in range(turns):
        messages = messages + [{"role": "user", "content": C.text_of_tokens(tok, rng, user_tokens)}]
        prompt = service.runtime.render_chat(messages, True)
        fin = service.engine.generate(
            GenerationRequest(
                prompt=prompt, max_tokens=reply_tokens, messages=messages, sampling=SamplingParams(temperature=0.0)
            )
        )
        replies.append(fin.token_ids)
        rows.append({"prompt_tokens": len(prompt), "cached_tokens": fin.cached_tokens})
        messages = messages + [{"role": "assistant", "content": fin.text}]
        while not service.engine.idle:
            time.sleep(0.005)
    return replies, rows, messages


def checkpoints(service) -> list[dict]:
    """Each checkpoint of the tree, shallowest first: its tokens, new tokens (since the checkpoint its KV
    continues, or all), bytes it added, bytes it holds alone, its state bytes."""
    rows = []
    for _, snap in sorted(service.cache.tree.snapshots(), key=lambda ns: ns[1].num_tokens):
        tail = snap.kv
        rows.append(
            {
                "tokens": snap.num_tokens,
                "new_tokens": snap.num_tokens - (tail.start if tail else 0),
                "added_bytes": snap.state_nbytes + (tail.nbytes if tail else 0),
                "alone_bytes": snap.nbytes,
                "state_bytes": snap.state_nbytes,
            }
        )
    return rows


def snapshot_ms(service) -> float | None:
    ms = [e["lock_ms"] for e in service.cache.telemetry.recent if e["event"] == "recorded"]
    return C.median(ms)


def warm_turn(service, messages: list, new_tokens: int, reps: int) -> dict:
    """Restore the deepest checkpoint for a new message, prefill it, argmax: median restore and TTFT seconds."""
    import torch

    rt, cache = service.runtime, service.cache
    rng = random.Random(99)
    prompt = rt.render_chat(
        messages + [{"role": "user", "content": C.text_of_tokens(rt.tokenizer, rng, new_tokens)}], True
    )

    def once() -> tuple[float, float, int]:
        t0 = time.perf_counter()
        restored = cache.restore(rt.adapter, prompt, count=False)
        t1 = time.perf_counter()
        live = restored.state
        int(torch.argmax(rt.adapter.forward(live, prompt[live.position :])))
        t2 = time.perf_counter()
        cache.release(restored)
        return t1 - t0, t2 - t0, restored.cached_tokens

    once()  # warm-up
    runs = [once() for _ in range(reps)]
    return {
        "prompt_tokens": len(prompt),
        "cached_tokens": runs[0][2],
        "restore_ms": C.median([r[0] for r in runs]) * 1e3,
        "ttft_ms": C.median([r[1] for r in runs]) * 1e3,
    }


def measure(model_dir, turns: int, user_tokens: int, reply_tokens: int, reps: int) -> dict:
    from hyserve.service import ServiceConfig, build_service

    out, replies = {"modes": {}}, None
    for name, share in MODES:
        svc = build_service(ServiceConfig(model_dir=model_dir, device="cpu", cache_bytes=1 << 40, kv_sharing=share))
        try:
            got, rows, messages = conversation(svc, turns, user_tokens, reply_tokens)
            if replies is not None and got != replies:
                sys.exit("replies differ between KV sharing on and off: a correctness bug")
            replies = got
            stats = svc.cache.stats()
            points = checkpoints(svc)
            if out["modes"] and [p["tokens"] for p in points] != [
                p["tokens"] for p in out["modes"]["shared"]["checkpoints"]
            ]:
                sys.exit("the two runs took different checkpoints")
            kv_per_token = max((p["alone_bytes"] - p["state_bytes"]) / p["tokens"] for p in points)
            out["modes"][name] = {
                "kv_sharing": share,
                "entries": stats["entries"],
                "bytes": stats["bytes"],
                "state_bytes": stats["state_bytes"],
                "kv_bytes": stats["kv_bytes"],
                "checkpoints": points,
                "kv_bytes_per_token": kv_per_token,
                "snapshot_ms": snapshot_ms(svc),
                "warm": warm_turn(svc, messages, user_tokens, reps),
            }
            out["turns"] = rows
        finally:
            svc.engine.stop()
    return out


def tables(result: dict) -> str:
    """The three tables, as docs/benchmarks.md shows them."""
    shared, whole = result["modes"]["shared"], result["modes"]["whole"]
    mib = lambda b: f"{b / 2**20:.2f}"  # noqa: E731
    last = result["turns"][-1]
    first = C.table(
        ["KV", "checkpoints", "cache MiB", "states MiB", "KV MiB", "snapshot ms (median)"],
        [
            [
                name,
                m["entries"],
                mib(m["bytes"]),
                mib(m["state_bytes"]),
                mib(m["kv_bytes"]),
                C.fmt_s(m["snapshot_ms"], 2),
            ]
            for name, m in (("shared", shared), ("whole copy", whole))
        ],
    )
    per_token = shared["kv_bytes_per_token"]
    second = C.table(
        [
            "checkpoint at tokens",
            "new tokens",
            "added, shared KiB",
            "state + new tokens' KV KiB",
            "alone (whole copy) KiB",
        ],
        [
            [
                p["tokens"],
                p["new_tokens"],
                f"{p['added_bytes'] / 1024:.1f}",
                f"{(p['state_bytes'] + p['new_tokens'] * per_token) / 1024:.1f}",
                f"{w['alone_bytes'] / 1024:.1f}",
            ]
            for p, w in zip(shared["checkpoints"], whole["checkpoints"])
        ],
    )
    third = C.table(
        ["KV", "history tokens", "prompt tokens", "restore ms", "warm-turn TTFT ms"],
        [
            [
                name,
                m["warm"]["cached_tokens"],
                m["warm"]["prompt_tokens"],
                C.fmt_s(m["warm"]["restore_ms"], 2),
                C.fmt_s(m["warm"]["ttft_ms"], 1),
            ]
            for name, m in (("shared", shared), ("whole copy", whole))
        ],
    )
    note = (
        f"{len(result['turns'])} turns, the last prompt {last['prompt_tokens']} tokens ({last['cached_tokens']} "
        f"cached); KV {per_token:.0f} bytes per token. Cache bytes shared / whole copy = "
        f"{shared['bytes'] / whole['bytes']:.2f}."
    )
    return "\n\n".join([first, second, third, note])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny qwen3_5, 4 turns of ~60 tokens")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", dest="json_out", default=None)
    args = p.parse_args()
    C.setup_torch(args.threads)
    C.warn_if_busy()
    model_dir = C.ensure_model("qwen3_5", "tiny" if args.quick else "bench")
    result = measure(model_dir, *((4, 60, 8, 3) if args.quick else (8, 1000, 32, 5)))
    print(tables(result))
    if args.json_out:
        C.write_result(args.json_out, "bench_kv_sharing.py", result)


if __name__ == "__main__":
    main()

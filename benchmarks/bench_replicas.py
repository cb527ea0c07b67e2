"""Several replicas on Ray Serve: hyserve's checkpoint-aware router against Ray Serve's default router
(power of two choices) and Ray Serve LLM's PrefixCacheAffinityRouter, then the routing policies simulated
at 8+ replicas.

1. Live, all routers in one run on one local Ray cluster: 16 concurrent multi-turn chat sessions on 2
   replicas (greedy, streamed). Per router: cached / history on warm turns (cached prompt tokens over the
   previous turn's prompt + reply), the share of warm turns that stayed on the replica of their previous
   turn, TTFT p50 / p99 (client side, first content delta) and generated tokens/s. The replies of every
   router must be equal (greedy, exact caches): the script stops otherwise.
2. Simulated, no models: the same kind of sessions on 8 and 32 replicas, each replica a FIFO server whose
   prefill costs per uncached token, holding a bounded LRU of exact checkpoints; routers see the replicas'
   checkpoints as published every second (hyserve's router with and without its memory of where it sent
   each prompt, power of two choices, and random).

    python benchmarks/bench_replicas.py --quick     # tiny qwen3_5, 8 sessions x 3 turns, a smoke test
    python benchmarks/bench_replicas.py --json benchmarks/results/replicas.json   # bench qwen3_5, 16 x 4

Needs `pip install 'hyserve[ray]'`.
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import json
import logging
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common as C  # noqa: E402

POW2 = "ray.serve._private.request_router.pow_2_router.PowerOfTwoChoicesRequestRouter"
AFFINITY = "ray.serve.llm.request_router.PrefixCacheAffinityRouter"
# the same class, without `ray.serve.llm`'s package import (which needs pyarrow, not a hyserve dependency)
AFFINITY_INTERNAL = (
    "ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router.PrefixCacheAffinityRouter"
)


def routers() -> tuple[dict[str, str], list[str]]:
    """{name: request router class path} of the routers this machine can run, and notes on the others."""
    from hyserve.scale.deployment import ROUTER

    found, notes = {"hyserve": ROUTER, "pow2 (Ray default)": POW2}, []
    for path in (AFFINITY, AFFINITY_INTERNAL):
        module, _, name = path.rpartition(".")
        try:
            getattr(__import__(module, fromlist=[name]), name)
        except Exception as exc:  # noqa: BLE001 - any import failure is reported, not fatal
            notes.append(f"{path} does not import: {type(exc).__name__}: {exc}")
            continue
        found["PrefixCacheAffinityRouter"] = path
        break
    return found, notes


# -- 1. live ------------------------------------------------------------------------------------------------
async def session(client, model: str, idx: int, turns: int, words: int, reply_tokens: int, rng: random.Random):
    messages = [{"role": "system", "content": f"You are assistant number {idx}. " + C.prose(rng, words)}]
    out = []
    await asyncio.sleep(rng.random() * 0.5)
    for turn in range(turns):
        messages.append({"role": "user", "content": C.prose(rng, max(8, words // 4))})
        body = {
            "model": model,
            "messages": messages,
            "max_tokens": reply_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        t0, ttft, text, usage = time.perf_counter(), None, [], None
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            replica = r.headers.get("x-hyserve-replica")
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for choice in chunk.get("choices", []):
                    piece = choice["delta"].get("content")
                    if piece:
                        ttft = ttft if ttft is not None else time.perf_counter() - t0
                        text.append(piece)
        reply = "".join(text)
        out.append(
            {
                "session": idx,
                "turn": turn,
                "replica": replica,
                "ttft": ttft if ttft is not None else time.perf_counter() - t0,
                "prompt_tokens": usage["prompt_tokens"],
                "completion_tokens": usage["completion_tokens"],
                "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
                "reply": reply,
            }
        )
        messages.append({"role": "assistant", "content": reply})
        await asyncio.sleep(rng.random() * 0.2)  # a reader between turns
    return out


async def drive(base: str, model: str, sessions: int, turns: int, words: int, reply_tokens: int):
    import httpx

    async with httpx.AsyncClient(base_url=base, timeout=600) as client:
        t0 = time.perf_counter()
        per = await asyncio.gather(
            *(session(client, model, i, turns, words, reply_tokens, random.Random(i)) for i in range(sessions))
        )
        return [row for rows in per for row in rows], time.perf_counter() - t0


def summarize(rows: list[dict], seconds: float) -> dict:
    by = {(r["session"], r["turn"]): r for r in rows}
    warm = [(r, by[r["session"], r["turn"] - 1]) for r in rows if r["turn"] > 0]
    history = sum(p["prompt_tokens"] + p["completion_tokens"] for _, p in warm)
    cached = sum(min(r["cached_tokens"], p["prompt_tokens"] + p["completion_tokens"]) for r, p in warm)
    ttfts = sorted(r["ttft"] for r in rows)
    warm_ttfts = sorted(r["ttft"] for r, _ in warm)

    def pct(xs, q):
        return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else None

    return {
        "requests": len(rows),
        "warm_turns": len(warm),
        "history_tokens": history,
        "cached_tokens": cached,
        "cached_over_history": round(cached / history, 4) if history else None,
        "stayed": round(sum(r["replica"] == p["replica"] for r, p in warm) / len(warm), 4) if warm else None,
        "ttft_p50": pct(ttfts, 0.5),
        "ttft_p99": pct(ttfts, 0.99),
        "warm_ttft_p50": pct(warm_ttfts, 0.5),
        "warm_ttft_p99": pct(warm_ttfts, 0.99),
        "seconds": round(seconds, 3),
        "tokens_per_s": round(sum(r["completion_tokens"] for r in rows) / seconds, 2),
    }


def live(
    model_dir: Path, sessions: int, turns: int, words: int, reply_tokens: int, replica_cpus: float, threads: int
) -> dict:
    import ray

    from hyserve.cache.policy import CheckpointPolicy
    from hyserve.scale import launch
    from hyserve.server.run import free_port
    from hyserve.service import ServiceConfig

    found, notes = routers()
    for note in notes:
        print(note, file=sys.stderr)
    cfg = ServiceConfig(
        model_dir=model_dir,
        served_model_name="bench",
        device="cpu",
        cache_bytes=2 << 30,
        policy=CheckpointPolicy(),
        max_running=16,
        max_waiting=256,
    )
    port = free_port()
    ray.init(include_dashboard=False, logging_level=logging.WARNING, log_to_driver=False)
    results, replies = {}, None
    try:
        for name, path in found.items():
            print(f"{name}: deploying 2 replicas ...", file=sys.stderr, flush=True)
            launch.start(cfg, 2, "127.0.0.1", port, replica_cpus=replica_cpus, threads=threads, router=path)
            rows, seconds = asyncio.run(
                drive(f"http://127.0.0.1:{port}", "bench", sessions, turns, words, reply_tokens)
            )
            got = {(r["session"], r["turn"]): r["reply"] for r in rows}
            if replies is not None and got != replies:
                sys.exit(f"replies under {name} differ from the first router's: a correctness bug")
            replies = got
            results[name] = summarize(rows, seconds)
            print(f"{name}: {results[name]}", file=sys.stderr, flush=True)
            from ray import serve

            serve.delete(launch.APP_NAME)
    finally:
        launch.stop()
    return {
        "sessions": sessions,
        "turns": turns,
        "replicas": 2,
        "replica_cpus": replica_cpus,
        "reply_tokens": reply_tokens,
        "routers": results,
        "notes": notes,
    }


# -- 2. simulated -------------------------------------------------------------------------------------------
class SimReplica:
    """A FIFO server holding an LRU of exact checkpoints ({key: length}) and what it last published."""

    def __init__(self, name: str, capacity: int):
        self.name, self.capacity = name, capacity
        self.held: dict[str, int] = {}
        self.busy_until = 0.0
        self.load = 0  # queued + running
        self.published: list[tuple[str, int]] = []

    def deepest(self, salt: str, tokens: list[int]) -> int:
        from hyserve.scale.publish import prefix_keys

        lengths = sorted({n for n in self.held.values() if n < len(tokens)}, reverse=True)
        keys = prefix_keys(salt, tokens, lengths)
        return next((n for n in lengths if self.held.get(keys[n]) == n), 0)

    def record(self, salt: str, tokens: list[int]) -> None:
        from hyserve.scale.publish import prefix_keys

        key = prefix_keys(salt, tokens, [len(tokens)])[len(tokens)]
        self.held.pop(key, None)
        self.held[key] = len(tokens)
        while len(self.held) > self.capacity:
            self.held.pop(next(iter(self.held)))


def simulate(
    policy: str,
    replicas: int,
    sessions: int,
    turns: int,
    seed: int = 0,
    prefill_per_token: float = 2e-4,
    decode_per_token: float = 0.01,
    history0: int = 1000,
    new_tokens: int = 60,
    reply_tokens: int = 40,
    capacity: int = 16,
    stats_period: float = 1.0,
    think: float = 0.5,
) -> dict:
    from hyserve.scale.router import CheckpointRouting

    rng = random.Random(seed)
    reps = [SimReplica(f"r{i}", capacity) for i in range(replicas)]
    by_name = {r.name: r for r in reps}
    routing = CheckpointRouting(imbalance=4)
    prompts = {s: [rng.randrange(50_000) for _ in range(history0)] for s in range(sessions)}
    events = [(rng.random() * think, 0, "arrive", s, 0) for s in range(sessions)]
    events += [(k * stats_period, 1, "publish", None, None) for k in range(1, 100_000)]
    heapq.heapify(events)
    waits, warm_history, warm_cached, done = [], 0, 0, 0
    last_history: dict[int, int] = {}
    while events and done < sessions * turns:
        t, _, kind, s, turn = heapq.heappop(events)
        if kind == "publish":
            for r in reps:
                r.published = list(r.held.items())
                routing.update(r.name, r.published)
            continue
        if kind == "arrive":
            prompt = prompts[s] + [rng.randrange(50_000) for _ in range(new_tokens)]
            loads = {r.name: r.load for r in reps}
            if policy.startswith("hyserve"):
                name = routing.choose("", prompt, loads).replica
                routing.sent(name)
                if policy == "hyserve":
                    routing.remember(name, "", prompt)
            elif policy == "pow2":
                a, b = rng.sample(reps, 2)
                name = min((a, b), key=lambda r: r.load).name
            else:
                name = rng.choice(reps).name
            rep = by_name[name]
            cached = rep.deepest("", prompt)
            start = max(t, rep.busy_until)
            service = (len(prompt) - cached) * prefill_per_token + reply_tokens * decode_per_token
            rep.busy_until, rep.load = start + service, rep.load + 1
            if turn > 0:
                warm_history += last_history[s]
                warm_cached += min(cached, last_history[s])
            waits.append(start + (len(prompt) - cached) * prefill_per_token - t)  # time to first token
            heapq.heappush(events, (start + service, 0, "finish", s, (turn, name, prompt)))
        else:  # finish
            turn, name, prompt = turn
            rep = by_name[name]
            rep.load -= 1
            reply = [rng.randrange(50_000) for _ in range(reply_tokens)]
            rep.record("", prompt)  # the history checkpoint ...
            rep.record("", prompt + reply)  # ... and the reply's
            prompts[s] = prompt + reply
            last_history[s] = len(prompt) + reply_tokens
            done += 1
            if turn + 1 < turns:
                heapq.heappush(events, (t + rng.random() * think, 0, "arrive", s, turn + 1))
    waits.sort()
    return {
        "policy": policy,
        "replicas": replicas,
        "sessions": sessions,
        "turns": turns,
        "cached_over_history": round(warm_cached / warm_history, 4) if warm_history else None,
        "ttft_mean": round(sum(waits) / len(waits), 4),
        "ttft_p99": round(waits[int(0.99 * (len(waits) - 1))], 4),
    }


SIM_POLICIES = ("hyserve", "hyserve without memory", "pow2", "random")


def simulated(quick: bool) -> list[dict]:
    sizes = [(8, 32, 4)] if quick else [(8, 64, 8), (32, 256, 8)]
    return [simulate(p, n, s, t) for n, s, t in sizes for p in SIM_POLICIES]


# -- report -------------------------------------------------------------------------------------------------
def tables(result: dict) -> str:
    lv = result["live"]
    rows = [
        [
            name,
            C.fmt_pct(r["cached_over_history"]),
            C.fmt_pct(r["stayed"]),
            C.fmt_s(r["ttft_p50"]),
            C.fmt_s(r["ttft_p99"]),
            C.fmt_s(r["warm_ttft_p50"]),
            r["tokens_per_s"],
        ]
        for name, r in lv["routers"].items()
    ]
    out = [
        f"{lv['sessions']} concurrent sessions x {lv['turns']} turns on {lv['replicas']} replicas "
        f"({lv['replica_cpus']} CPU each), {lv['reply_tokens']}-token greedy replies, equal under every router:",
        "",
        C.table(
            [
                "router",
                "cached / history (warm)",
                "warm turns on the same replica",
                "TTFT p50 (s)",
                "TTFT p99 (s)",
                "warm TTFT p50 (s)",
                "tokens/s",
            ],
            rows,
        ),
    ]
    out += [f"\n{note}" for note in lv.get("notes", [])]
    sim = result["simulated"]
    out += [
        "",
        "Simulated (no models; FIFO replicas, 16 checkpoints each, stats published every second):",
        "",
        C.table(
            ["replicas", "sessions x turns", "router", "cached / history (warm)", "TTFT mean (s)", "TTFT p99 (s)"],
            [
                [
                    r["replicas"],
                    f"{r['sessions']} x {r['turns']}",
                    r["policy"],
                    C.fmt_pct(r["cached_over_history"]),
                    r["ttft_mean"],
                    r["ttft_p99"],
                ]
                for r in sim
            ],
        ),
    ]
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny qwen3_5, 8 sessions x 3 turns, 8-replica simulation")
    p.add_argument("--sessions", type=int, default=None)
    p.add_argument("--turns", type=int, default=None)
    p.add_argument("--replica-cpus", type=float, default=None, help="CPUs per replica (default 1; --quick 0.5)")
    p.add_argument("--json", dest="json_out", default=None)
    args = p.parse_args()
    model_dir = C.ensure_model("qwen3_5", "tiny" if args.quick else "bench")
    sessions = args.sessions or (8 if args.quick else 16)
    turns = args.turns or (3 if args.quick else 4)
    cpus = args.replica_cpus or (0.5 if args.quick else 1.0)
    result = {
        "live": live(
            model_dir, sessions, turns, 30 if args.quick else 300, 16 if args.quick else 48, cpus, max(1, round(cpus))
        ),
        "simulated": simulated(args.quick),
    }
    print(tables(result))
    if args.json_out:
        C.write_result(args.json_out, "bench_replicas.py", result)


if __name__ == "__main__":
    main()

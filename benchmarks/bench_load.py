"""Concurrent load and soak over real HTTP: N multi-turn chat sessions at once against one server.

One hyserve server (bench-size qwen3_5 hybrid by default, prefix cache on) runs as a `hyserve serve`
process of its own on 127.0.0.1 (`bench_common.ServerProcess`), as users run it: the clients in this process
share no interpreter lock with the server's model thread. For every N in --sessions (default 1, 4, 16),
N chat sessions start together; each sends T turns (default 4) of ~100-300-token synthetic user
messages with max_tokens 128 (the output length of vLLM's `bench serve` random dataset), temperature 0,
and sends the reply text back as the assistant message, like a chat client. All N are measured in one
run against the same server process; the prefix cache is cleared (DELETE /v1/cache) before each N.
Shorter replies make the load prefill-bound: the bench model's random-weight replies do not re-tokenize
to the ids it generated, so each turn also re-runs the previous reply (`--max-tokens 32`: ~8 prompt tokens
computed per token generated at N=16), and prefill on 2 cores is compute-bound however many sessions wait.

Client side (`openai.AsyncOpenAI`, stream=True): TTFT = request sent -> first content chunk;
ITL = gap between consecutive content chunks of one stream. Server side (GET /metrics, differences
over each N): runtime-lock hold per engine step (p99 estimated from the histogram buckets), decode
batch size, cache hits/misses. `decode tok/s` = tokens after the first of every reply / the time
during which at least one stream was between its first and last content chunk (so it includes the
prefills of other sessions' turns that ran in between, at N=1 it does not); `steady decode tok/s` = the
same tokens, counted only while all N sessions were in flight (from the last session's first request to
the first session's last reply: sessions finish at different times, and the wind-down after that is a
load of fewer than N sessions), over that span, prefills included at every N; `pass tok/s` = rows
decoded by batched decode passes / seconds spent in those passes (server side: what batching itself
yields under this load).

`--soak S`: 16 sessions loop conversations (a new conversation after T turns) for S seconds against
the same server with a bounded cache (--cache-mib, default 512), sampling the server process's RSS every
--rss-every seconds. Reports RSS start/max/end, requests, failures.

The decode-step probe (no HTTP) loads the model in this process: after the server process has exited,
or alone with --probe-only. The load phases only load the tokenizer here.

    python benchmarks/bench_load.py                   # full: bench qwen3_5, N=1,4,16, 4 turns, soak 300 s
    python benchmarks/bench_load.py --quick           # tiny qwen3_5, N=1,4, 2 turns, soak 10 s (< 1 minute)
    python benchmarks/bench_load.py --sessions 1,16 --turns 3 --soak 0
    python benchmarks/bench_load.py --probe-only      # only the decode-step probe (batched vs unbatched decode)

Results: benchmarks/results/load.json (full) or load-quick.json (--quick); --json overrides.

Everything is loopback-only, bounded in count (sessions x turns) and time (--soak, --phase-timeout),
and stops by itself. Exit status is 1 if any request failed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common as C  # noqa: E402

TARGET_DECODE_RATIO = 3.0  # decode tok/s at the largest N vs N=1 (issue target)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny model, N=1,4, 2 turns, soak 10 s (< 1 minute)")
    p.add_argument("--sessions", default=None, help="comma-separated session counts (default 1,4,16; quick 1,4)")
    p.add_argument("--turns", type=int, default=None, help="turns per session (default 4; quick 2)")
    p.add_argument("--max-tokens", type=int, default=128, help="reply length per turn (default 128)")
    p.add_argument("--min-user-tokens", type=int, default=100)
    p.add_argument("--max-user-tokens", type=int, default=300)
    p.add_argument("--soak", type=float, default=None, help="soak seconds (default 300; quick 10; 0 = skip)")
    p.add_argument("--soak-sessions", type=int, default=16)
    p.add_argument("--rss-every", type=float, default=None, help="RSS sample interval, s (default 10; quick 2)")
    p.add_argument("--cache-mib", type=int, default=512, help="prefix-cache budget in MiB (default 512)")
    p.add_argument(
        "--prefill-chunk",
        type=int,
        default=None,
        help="hyserve serve --prefill-chunk (default: hyserve's default, 512)",
    )
    p.add_argument("--max-running", type=int, default=16)
    p.add_argument("--max-waiting", type=int, default=64)
    p.add_argument(
        "--phase-timeout",
        type=float,
        default=600.0,
        help="seconds; a load phase still running after this is cancelled (its requests count as errors)",
    )
    p.add_argument("--request-timeout", type=float, default=300.0, help="client timeout per request, s")
    p.add_argument(
        "--probe-ctx",
        type=int,
        default=None,
        help="context tokens per state in the decode-step probe (default 1000; quick 500; 0 = skip)",
    )
    p.add_argument(
        "--probe-only",
        action="store_true",
        help="only the decode-step probe (no server, no load, no soak); prints its table, writes no JSON",
    )
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default 2)")
    p.add_argument(
        "--json",
        dest="json_out",
        default=None,
        help="result file (default benchmarks/results/load.json; quick: load-quick.json, so a smoke "
        "test never overwrites full results)",
    )
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.sessions = [int(x) for x in (args.sessions or ("1,4" if args.quick else "1,4,16")).split(",") if x]
    args.turns = args.turns or (2 if args.quick else 4)
    if args.json_out is None:
        args.json_out = str(C.RESULTS_DIR / ("load-quick.json" if args.quick else "load.json"))
    if args.soak is None:
        args.soak = 10.0 if args.quick else 300.0
    if args.probe_ctx is None:
        args.probe_ctx = 500 if args.quick else 1000
    if args.rss_every is None:
        args.rss_every = 2.0 if args.quick else 10.0
    if max(args.sessions) > args.max_running:
        p.error(f"--sessions {max(args.sessions)} > --max-running {args.max_running}")
    return args


def resolve_model(size: str) -> Path:
    """benchmarks/.models/qwen3_5-<size> if it exists, else the shared <size>-qwen3_5 folder that the
    other benchmarks use (built once, atomically, by bench_common.ensure_model; never rebuilt if complete)."""
    named = C.MODELS_DIR / f"qwen3_5-{size}"
    if (named / "config.json").is_file():
        return named
    return C.ensure_model("qwen3_5", size)


# -- statistics -------------------------------------------------------------------------------
def pct(xs, q: float):
    """q-th percentile (0..100) with linear interpolation between order statistics, or None."""
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    k = (len(xs) - 1) * q / 100.0
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def union_seconds(intervals) -> float:
    total, end = 0.0, None
    for a, b in sorted(intervals):
        if end is None or a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


def steady_window(results: list[dict], n: int) -> tuple[float, float] | None:
    """The span in which all `n` sessions were in flight: from the last session's first request to the first
    session's last reply. Before it sessions are still starting; after it the phase winds down, with fewer
    than `n` sessions left (they end at different times), which is not a load of `n` sessions any more."""
    spans: dict[int, list[float]] = {}
    for r in results:
        a, b = spans.setdefault(r["session"], [r["start"], r["end"]])
        spans[r["session"]] = [min(a, r["start"]), max(b, r["end"])]
    if len(spans) < n:
        return None
    start, end = max(a for a, _ in spans.values()), min(b for _, b in spans.values())
    return (start, end) if end > start else None


def decode_tokens_between(results: list[dict], start: float, end: float) -> float:
    """Tokens after the first of each reply whose chunk arrived in [start, end] (a reply's decode tokens are
    spread evenly over its chunks after the first: the detokenizer may hold a token back and send two)."""
    total = 0.0
    for r in results:
        later = r["chunk_times"][1:]
        if later:
            per = (r["completion_tokens"] - 1) / len(later)
            total += per * sum(1 for t in later if start <= t <= end)
    return total


def service_config(args, model_dir: Path):
    """The server's settings: passed to `hyserve serve` as flags (`serve_flags`) and used as they are by the
    in-process service of the decode-step probe."""
    from hyserve.service import ServiceConfig

    return ServiceConfig(
        model_dir=model_dir,
        served_model_name="bench",
        device="cpu",
        max_running=args.max_running,
        max_waiting=args.max_waiting,
        cache_bytes=args.cache_mib << 20,
        **({"prefill_chunk": args.prefill_chunk} if args.prefill_chunk else {}),
    )


def serve_flags(cfg) -> list[str]:
    """`hyserve serve` options for the settings `service_config` changes (the rest have the same defaults)."""
    return [
        "--max-running",
        str(cfg.max_running),
        "--max-waiting",
        str(cfg.max_waiting),
        "--cache-bytes",
        str(cfg.cache_bytes),
        "--prefill-chunk",
        str(cfg.prefill_chunk),
    ]


def param_count(model_dir: Path) -> int:
    """Parameters in the model's safetensors files, from their headers (no weights are loaded)."""
    import math

    from safetensors import safe_open

    total = 0
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(f, "pt") as st:
            total += sum(math.prod(st.get_slice(k).get_shape()) for k in st.keys())
    return total


# -- server metrics ---------------------------------------------------------------------------
async def scrape(http) -> dict:
    """All Prometheus samples of GET /metrics as {(sample name, ((label, value), ...)): value},
    plus GET /v1/cache under key "cache"."""
    out: dict = C.metric_samples((await http.get("/metrics")).text)
    out["cache"] = (await http.get("/v1/cache")).json()
    return out


def _sum(m: dict, name: str, **labels) -> float:
    want = set(labels.items())
    return sum(v for k, v in m.items() if k != "cache" and k[0] == name and want <= set(k[1]))


def delta(a: dict, b: dict, name: str, **labels) -> float:
    return _sum(b, name, **labels) - _sum(a, name, **labels)


def hist_delta(a: dict, b: dict, name: str, **labels) -> dict:
    """Bucket counts (cumulative, by upper bound), count and sum of a histogram between two scrapes."""
    want = set(labels.items())
    buckets = {}
    for k, v in b.items():
        if k == "cache" or k[0] != f"{name}_bucket" or not want <= set(k[1]):
            continue
        le = dict(k[1])["le"]
        buckets[float(le)] = v - a.get(k, 0.0)
    return {
        "buckets": sorted(buckets.items()),
        "count": delta(a, b, f"{name}_count", **labels),
        "sum": delta(a, b, f"{name}_sum", **labels),
    }


def hist_quantile(h: dict, q: float) -> tuple[float | None, bool]:
    """Estimate the q-quantile (0..1) from cumulative buckets, interpolating linearly inside the bucket
    (the Prometheus histogram_quantile rule). Returns (value, open): open=True means the quantile lies in
    the +Inf bucket and the value is only the lower bound (the largest finite bucket bound)."""
    total = h["count"]
    if not total:
        return None, False
    rank = q * total
    prev_le, prev_c = 0.0, 0.0
    for le, c in h["buckets"]:
        if c >= rank:
            if le == float("inf"):
                return prev_le, True
            if c == prev_c:
                return le, False
            return prev_le + (le - prev_le) * (rank - prev_c) / (c - prev_c), False
        prev_le, prev_c = le, c
    return prev_le, True


# -- workload ---------------------------------------------------------------------------------
class Conversation:
    """A fixed system prompt (shared by every session) and T synthetic user messages from one seed."""

    def __init__(self, tokenizer, system: str, turns: int, seed: int, lo: int, hi: int):
        rng = random.Random(seed)
        self.system = system
        self.users = [f"Turn {t + 1}. " + C.text_of_tokens(tokenizer, rng, rng.randint(lo, hi)) for t in range(turns)]


async def chat_turn(client, model: str, messages: list[dict], max_tokens: int) -> dict:
    t0 = time.perf_counter()
    stream = await client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunk_times, parts, usage, finish = [], [], None, None
    async for chunk in stream:
        now = time.perf_counter()
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            d = choice.delta
            if choice.finish_reason:
                finish = choice.finish_reason
            # the first chunk only announces the role; content chunks carry generated text
            if d is not None and d.role is None and d.content is not None:
                chunk_times.append(now)
                parts.append(d.content)
    t1 = time.perf_counter()
    if usage is None:
        raise RuntimeError("stream ended without a usage chunk")
    if finish not in ("length", "stop"):
        raise RuntimeError(f"unexpected finish_reason {finish!r}")
    details = getattr(usage, "prompt_tokens_details", None)
    return {
        "start": t0,
        "end": t1,
        "ttft": chunk_times[0] - t0 if chunk_times else None,
        "itl": [b - a for a, b in zip(chunk_times, chunk_times[1:])],
        "first_chunk": chunk_times[0] if chunk_times else None,
        "chunk_times": chunk_times,
        "last_chunk": chunk_times[-1] if chunk_times else None,
        "text": "".join(parts),
        "finish": finish,
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "cached_tokens": (details.cached_tokens or 0) if details else 0,
    }


async def run_session(
    client,
    model,
    conv: Conversation,
    turns: int,
    max_tokens: int,
    results: list,
    errors: list,
    deadline: float | None = None,
    session: int = 0,
) -> list[str]:
    """One conversation, turn by turn; appends one dict per completed request to `results`. Returns
    the reply texts. Stops at the first failed turn (the history would be broken) or past `deadline`."""
    messages = [{"role": "system", "content": conv.system}]
    replies = []
    for t in range(turns):
        if deadline is not None and time.perf_counter() >= deadline:
            break
        messages.append({"role": "user", "content": conv.users[t]})
        try:
            r = await chat_turn(client, model, messages, max_tokens)
        except Exception as exc:  # counted, reported, never retried
            errors.append(f"turn {t + 1}: {type(exc).__name__}: {exc}"[:300])
            break
        r["turn"], r["session"] = t + 1, session
        results.append(r)
        replies.append(r["text"])
        messages.append({"role": "assistant", "content": r["text"]})
    return replies


async def load_phase(client, http, model, n: int, convs: list[Conversation], args) -> dict:
    await http.delete("/v1/cache")
    before = await scrape(http)
    results, errors = [], []
    mon = C.CpuMonitor()
    t0 = time.perf_counter()
    tasks = [
        asyncio.create_task(
            run_session(client, model, convs[i], args.turns, args.max_tokens, results, errors, session=i)
        )
        for i in range(n)
    ]
    done, pending = await asyncio.wait(tasks, timeout=args.phase_timeout)
    for task in pending:
        task.cancel()
        errors.append(f"phase timeout after {args.phase_timeout:.0f}s")
    if pending:
        await asyncio.gather(*pending, return_exceptions=True)
    wall = time.perf_counter() - t0
    others = mon.stop()
    replies = [t.result() if t in done and not t.cancelled() else [] for t in tasks]
    after = await scrape(http)
    expected = n * args.turns
    if len(results) < expected and not errors:
        errors.append(f"only {len(results)} of {expected} requests completed")

    out_tokens = sum(r["completion_tokens"] for r in results)
    dec_tokens = sum(max(0, r["completion_tokens"] - 1) for r in results)
    dec_time = union_seconds([(r["first_chunk"], r["last_chunk"]) for r in results if r["first_chunk"]])
    window = steady_window(results, n)
    steady_tokens = decode_tokens_between(results, *window) if window else None
    ttfts = [r["ttft"] for r in results]
    warm = [r["ttft"] for r in results if r["turn"] > 1]
    itls = [x for r in results for x in r["itl"]]
    step = hist_delta(before, after, "hyserve_runtime_lock_hold_seconds", op="step")
    p99_step, p99_open = hist_quantile(step, 0.99)
    p50_step, _ = hist_quantile(step, 0.50)
    batch = hist_delta(before, after, "hyserve_decode_batch_size")
    passes = hist_delta(before, after, "hyserve_decode_pass_seconds")
    hits = delta(before, after, "hyserve_cache_hits_total")
    misses = delta(before, after, "hyserve_cache_misses_total")
    c0, c1 = before["cache"], after["cache"]
    lookups_api = c1["lookups"] - c0["lookups"]
    return {
        "sessions": n,
        "turns": args.turns,
        "requests": len(results),
        "errors": len(errors),
        "error_messages": errors[:20],
        "wall_s": wall,
        "others_busy": others,
        "output_tokens": out_tokens,
        "output_tok_s": out_tokens / wall if wall else None,
        "decode_tokens": dec_tokens,
        "decode_active_s": dec_time,
        "decode_tok_s": dec_tokens / dec_time if dec_time else None,
        "steady_s": window[1] - window[0] if window else None,
        "steady_decode_tokens": steady_tokens,
        "steady_decode_tok_s": steady_tokens / (window[1] - window[0]) if window else None,
        "prompt_tokens": sum(r["prompt_tokens"] for r in results),
        "cached_tokens": sum(r["cached_tokens"] for r in results),
        "server_prefill_tokens": delta(before, after, "hyserve_prefill_tokens_computed_total"),
        "server_generated_tokens": delta(before, after, "hyserve_generation_tokens_total"),
        "ttft_p50": pct(ttfts, 50),
        "ttft_p99": pct(ttfts, 99),
        "ttft_max": pct(ttfts, 100),
        "ttft_warm_p50": pct(warm, 50),
        "itl_p50": pct(itls, 50),
        "itl_p99": pct(itls, 99),
        "itl_max": pct(itls, 100),
        "itl_samples": len(itls),
        "lock_step_p50": p50_step,
        "lock_step_p99": p99_step,
        "lock_step_p99_open": p99_open,
        "lock_step_mean": step["sum"] / step["count"] if step["count"] else None,
        "steps": step["count"],
        "lock_step_hist": step["buckets"],
        "decode_passes": batch["count"],
        "decode_pass_s": passes["sum"],
        "decode_pass_tok_s": batch["sum"] / passes["sum"] if passes["sum"] else None,
        "decode_batch_mean": batch["sum"] / batch["count"] if batch["count"] else None,
        "decode_gathers": delta(before, after, "hyserve_decode_batch_gathers_total"),
        "cache_hits": hits,
        "cache_misses": misses,
        "hit_rate": hits / (hits + misses) if hits + misses else None,
        "hit_rate_api": (c1["hits"] - c0["hits"]) / lookups_api if lookups_api else None,
        # requests that got nothing from the cache, by turn (turn 1 can only hit the shared system prompt)
        "uncached_by_turn": {
            t: sum(1 for r in results if r["turn"] == t and not r["cached_tokens"]) for t in range(1, args.turns + 1)
        },
        "replies": replies,
        "per_request": [
            {k: v for k, v in r.items() if k not in ("text", "itl")} | {"itl_n": len(r["itl"])} for r in results
        ],
    }


async def soak_phase(client, http, model, tokenizer, system: str, args, server_pid: int) -> dict:
    """--soak-sessions sessions loop fresh conversations until the deadline; the server process's RSS is
    sampled meanwhile."""
    before = await scrape(http)
    results, errors = [], []
    t0 = time.perf_counter()
    deadline = t0 + args.soak
    # (t, server RSS, cache bytes, live-state bytes: running requests' states and the decode batch)
    samples = [(0.0, C.pid_rss_bytes(server_pid), before["cache"]["bytes"], _sum(before, "hyserve_live_state_bytes"))]
    started = [0]
    stop = asyncio.Event()

    async def sample():
        t, rss = time.perf_counter() - t0, C.pid_rss_bytes(server_pid)
        try:
            m = await scrape(http)
            cached, live = m["cache"]["bytes"], _sum(m, "hyserve_live_state_bytes")
        except Exception:  # a missed sample is not a request failure
            cached = live = None
        samples.append((t, rss, cached, live))

    async def sampler():
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), timeout=args.rss_every)
            except TimeoutError:
                await sample()

    async def looper(i: int):
        k = 0
        while time.perf_counter() < deadline:
            conv = Conversation(
                tokenizer,
                system,
                args.turns,
                10_000_000 + args.seed * 100_000 + i * 1000 + k,
                args.min_user_tokens,
                args.max_user_tokens,
            )
            n_err = len(errors)
            started[0] += 1
            await run_session(client, model, conv, args.turns, args.max_tokens, results, errors, deadline)
            if len(errors) > n_err:
                await asyncio.sleep(1.0)  # a failure is counted; do not spin
            k += 1

    mon = C.CpuMonitor()
    samp = asyncio.create_task(sampler())
    loops = [asyncio.create_task(looper(i)) for i in range(args.soak_sessions)]
    # the loops stop starting requests at the deadline; in-flight ones get the request timeout to finish
    done, pending = await asyncio.wait(loops, timeout=args.soak + args.request_timeout)
    for task in pending:
        task.cancel()
        errors.append("soak session still running after the grace period: cancelled")
    if pending:
        await asyncio.gather(*pending, return_exceptions=True)
    wall = time.perf_counter() - t0
    stop.set()
    await samp
    await sample()
    others = mon.stop()
    after = await scrape(http)
    rss = [r for _, r, _, _ in samples if r is not None]
    other = [r - c for _, r, c, _ in samples if r is not None and c is not None]  # RSS not held by the cache
    # RSS held neither by the cache nor by running requests: what would grow if anything leaked. Its
    # highest sample in each third of the soak shows whether it levels off.
    rest = [(t, r - c - v) for t, r, c, v in samples if None not in (r, c, v)]
    thirds = [
        max((x for t, x in rest if k * args.soak / 3 <= t < (k + 1) * args.soak / 3), default=None) for k in range(3)
    ]
    ttfts = [r["ttft"] for r in results]
    out_tokens = sum(r["completion_tokens"] for r in results)
    return {
        "seconds": args.soak,
        "wall_s": wall,
        "sessions": args.soak_sessions,
        "others_busy": others,
        "requests": len(results),
        "failures": len(errors),
        "error_messages": errors[:20],
        "conversations_started": started[0],
        "output_tokens": out_tokens,
        "output_tok_s": out_tokens / wall if wall else None,
        "ttft_p50": pct(ttfts, 50),
        "ttft_p99": pct(ttfts, 99),
        "rss_start": rss[0] if rss else None,
        "rss_max": max(rss) if rss else None,
        "rss_end": rss[-1] if rss else None,
        "rss_samples": samples,
        "rss_minus_cache_start": other[0] if other else None,
        "rss_minus_cache_max": max(other) if other else None,
        "rss_minus_cache_end": other[-1] if other else None,
        "live_bytes_max_sampled": max((v for *_, v in samples if v is not None), default=None),
        "rss_rest_max_by_third": thirds,
        "rss_rest_end": rest[-1][1] if rest else None,
        "cache_budget_bytes": after["cache"]["budget_bytes"],
        "cache_bytes_end": after["cache"]["bytes"],
        "cache_entries_end": after["cache"]["entries"],
        "cache_evictions": delta(before, after, "hyserve_cache_evictions_total"),
        "cache_bytes_max_sampled": max(c for _, _, c, _ in samples if c is not None),
        "malloc_trims": delta(before, after, "hyserve_malloc_trim_seconds_count"),
        "malloc_trim_seconds": delta(before, after, "hyserve_malloc_trim_seconds_sum"),
        "hit_rate": (lambda h, m: h / (h + m) if h + m else None)(
            delta(before, after, "hyserve_cache_hits_total"), delta(before, after, "hyserve_cache_misses_total")
        ),
    }


# -- decode-step probe (no HTTP, no prefill): does one batched decode pass scale with N? ---------
def decode_probe(cfg, sizes: list[int], ctx: int, reps: int = 6) -> list[dict]:
    """Load the model into an in-process service of `cfg` (never while the server process runs: the two
    would share the cores), run the probe on its model thread, and stop the service."""
    from hyserve import model_thread  # where the server's own model work runs
    from hyserve.service import build_service

    service = build_service(cfg)
    try:
        return model_thread.run(_decode_probe, service, sizes, ctx, reps)
    finally:
        service.engine.stop()  # let the worker thread leave its loop before the interpreter exits
        worker = getattr(service.engine, "_worker", None)
        if worker is not None:
            worker.join(timeout=5)


def _decode_probe(service, sizes: list[int], ctx: int, reps: int = 6) -> list[dict]:
    """Time one decode token for n live states of ~`ctx` tokens each (lengths differ by 0-3 tokens, so the
    attention KV is padded as in the server): `forward_batch` as the engine calls it, its parts
    (hyserve.state.decode_batch.gather / model forward / scatter), and n separate single-state forwards."""
    import statistics

    import torch

    from hyserve.state.decode_batch import gather, scatter

    rt = service.runtime
    ad, model = rt.adapter, rt.model
    vocab = len(rt.tokenizer)
    med = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
    rows = []
    with rt.lock:  # this service serves no requests; the lock keeps its engine out
        base = ad.new_state()
        ids = [3 + (k * 7) % (vocab - 3) for k in range(ctx)]
        for i in range(0, ctx, service.config.prefill_chunk):
            ad.forward(base, ids[i : i + service.config.prefill_chunk])
        snap = ad.snapshot(base)
        for n in sizes:
            states = []
            for i in range(n):
                st = ad.restore(snap, list(base.tokens))
                for _ in range(i % 4):
                    ad.forward(st, [5])
                states.append(st)
            toks = [5] * n
            ad.forward_batch(states, toks)  # warm-up
            full, parts = [], []
            for _ in range(reps):
                t = time.perf_counter()
                ad.forward_batch(states, toks)
                full.append(time.perf_counter() - t)
            if n > 1:
                for _ in range(reps):
                    with torch.inference_mode():
                        t0 = time.perf_counter()
                        batch = gather(states, model.config, model.device)  # a fresh gather, to time it
                        mask, pos = batch.inputs(model.device)
                        t1 = time.perf_counter()
                        x = torch.tensor([[5]] * n, dtype=torch.long, device=model.device)
                        model(
                            input_ids=x,
                            use_cache=True,
                            logits_to_keep=1,
                            **{ad._cache_kw: batch.cache},
                            **ad.batch_inputs(mask, pos),
                        )
                        t2 = time.perf_counter()
                        scatter(batch, states, range(len(states)), toks)
                        t3 = time.perf_counter()
                    parts.append((t1 - t0, t2 - t1, t3 - t2))
            single = []
            for _ in range(max(2, reps // 2)):
                t = time.perf_counter()
                for st in states:
                    ad.forward(st, [5])
                single.append(time.perf_counter() - t)
            step = med(full)
            rows.append(
                {
                    "n": n,
                    "ctx": ctx,
                    "snapshot_mib": snap.nbytes / 2**20,
                    "batched_step_s": step,
                    "batched_tok_s": n / step,
                    "gather_s": med([a for a, _, _ in parts]),
                    "model_s": med([b for _, b, _ in parts]),
                    "scatter_s": med([c for _, _, c in parts]),
                    "unbatched_s": med(single),
                    "unbatched_tok_s": n / med(single),
                }
            )
            del states
    return rows


def probe_table(rows: list[dict]) -> str:
    headers = [
        "N",
        "ctx tok",
        "batched step ms",
        "gather ms",
        "model ms",
        "scatter ms",
        "batched tok/s",
        "N single forwards ms",
        "unbatched tok/s",
    ]
    return C.table(
        headers,
        [
            [
                r["n"],
                r["ctx"],
                _ms(r["batched_step_s"]),
                _ms(r["gather_s"]),
                _ms(r["model_s"]),
                _ms(r["scatter_s"]),
                C.fmt_ratio(r["batched_tok_s"], 1),
                _ms(r["unbatched_s"]),
                C.fmt_ratio(r["unbatched_tok_s"], 1),
            ]
            for r in rows
        ],
    )


# -- report -----------------------------------------------------------------------------------
def _ms(x) -> str:
    return "-" if x is None else f"{x * 1e3:.1f}"


def _lock(p: dict) -> str:
    if p["lock_step_p99"] is None:
        return "-"
    return (">" if p["lock_step_p99_open"] else "") + _ms(p["lock_step_p99"])


def load_table(phases: list[dict]) -> str:
    headers = [
        "N",
        "requests",
        "out tok",
        "prefill tok",
        "wall s",
        "out tok/s",
        "decode tok/s",
        "steady s",
        "steady decode tok/s",
        "pass tok/s",
        "TTFT p50 ms",
        "TTFT p99 ms",
        "warm TTFT p50 ms",
        "ITL p50 ms",
        "ITL p99 ms",
        "lock/step mean ms",
        "lock/step p99 ms",
        "mean decode batch",
        "gathers / passes",
        "hit rate",
        "errors",
        "bg CPU",
    ]
    rows = []
    for p in phases:
        rows.append(
            [
                p["sessions"],
                p["requests"],
                p["output_tokens"],
                int(p["server_prefill_tokens"]),
                f"{p['wall_s']:.1f}",
                C.fmt_ratio(p["output_tok_s"], 1),
                C.fmt_ratio(p["decode_tok_s"], 1),
                C.fmt_ratio(p.get("steady_s"), 1),
                C.fmt_ratio(p.get("steady_decode_tok_s"), 1),
                C.fmt_ratio(p.get("decode_pass_tok_s"), 1),
                _ms(p["ttft_p50"]),
                _ms(p["ttft_p99"]),
                _ms(p["ttft_warm_p50"]),
                _ms(p["itl_p50"]),
                _ms(p["itl_p99"]),
                _ms(p["lock_step_mean"]),
                _lock(p),
                C.fmt_ratio(p["decode_batch_mean"], 2),
                f"{p.get('decode_gathers', 0):.0f} / {p['decode_passes']:.0f}",
                C.fmt_pct(p["hit_rate"]),
                p["errors"],
                C.fmt_pct(p["others_busy"]),
            ]
        )
    return C.table(headers, rows)


def soak_table(s: dict) -> str:
    mib = lambda b: "-" if b is None else f"{b / 2**20:.0f}"  # noqa: E731
    headers = [
        "seconds",
        "sessions",
        "requests",
        "failures",
        "out tok/s",
        "TTFT p50 ms",
        "TTFT p99 ms",
        "RSS start MiB",
        "RSS max MiB",
        "RSS end MiB",
        "RSS-cache start/max/end MiB",
        "cache MiB end / budget",
        "live states max MiB",
        "RSS-cache-live max by third / end MiB",
        "evictions",
        "hit rate",
        "heap trims (mean ms)",
        "bg CPU",
    ]
    trims = s.get("malloc_trims") or 0
    row = [
        f"{s['wall_s']:.0f}",
        s["sessions"],
        s["requests"],
        s["failures"],
        C.fmt_ratio(s["output_tok_s"], 1),
        _ms(s["ttft_p50"]),
        _ms(s["ttft_p99"]),
        mib(s["rss_start"]),
        mib(s["rss_max"]),
        mib(s["rss_end"]),
        f"{mib(s['rss_minus_cache_start'])} / {mib(s['rss_minus_cache_max'])} / {mib(s['rss_minus_cache_end'])}",
        f"{mib(s['cache_bytes_end'])} / {mib(s['cache_budget_bytes'])}",
        mib(s.get("live_bytes_max_sampled")),
        " / ".join(mib(x) for x in s.get("rss_rest_max_by_third") or []) + f" / {mib(s.get('rss_rest_end'))}",
        int(s["cache_evictions"]),
        C.fmt_pct(s["hit_rate"]),
        f"{trims:.0f} ({s['malloc_trim_seconds'] / trims * 1e3:.1f})" if trims else "0",
        C.fmt_pct(s["others_busy"]),
    ]
    return C.table(headers, [row])


def reply_consistency(phases: list[dict]) -> dict:
    """Session i has the same conversation in every phase: compare its replies with the first phase
    that ran it (greedy decoding, so batched and unbatched decode should agree token for token)."""
    ref: dict[int, list[str]] = {}
    out = {"compared_turns": 0, "equal_turns": 0, "diverged": []}
    for p in phases:
        for i, replies in enumerate(p["replies"]):
            if i not in ref:
                ref[i] = replies
                continue
            for t, (a, b) in enumerate(zip(ref[i], replies)):
                out["compared_turns"] += 1
                if a == b:
                    out["equal_turns"] += 1
                else:
                    out["diverged"].append({"sessions": p["sessions"], "session": i, "turn": t + 1})
                    break  # later turns have a different history anyway
    return out


async def amain(args) -> int:
    import httpx
    from openai import AsyncOpenAI
    from transformers import AutoTokenizer

    threads = C.setup_torch(args.threads)
    C.warn_if_busy()
    size = "tiny" if args.quick else "bench"
    model_dir = resolve_model(size)
    t_start = time.perf_counter()
    cfg = service_config(args, model_dir)
    if args.probe_only:
        rows = decode_probe(cfg, sorted(set(args.sessions)), args.probe_ctx or 1000)
        print(probe_table(rows))
        if len(rows) > 1:
            print(
                f"probe batched tok/s N={rows[-1]['n']} / N={rows[0]['n']} = "
                f"{rows[-1]['batched_tok_s'] / rows[0]['batched_tok_s']:.2f}x"
            )
        return 0
    tok = AutoTokenizer.from_pretrained(model_dir)  # the conversations' token counts; no weights here
    info = C.machine_info()
    info["torch_threads"] = threads
    params = param_count(model_dir)
    rng = random.Random(args.seed)
    system = "You are a helpful assistant. " + C.text_of_tokens(tok, rng, 40)
    convs = [
        Conversation(tok, system, args.turns, args.seed * 100_000 + i, args.min_user_tokens, args.max_user_tokens)
        for i in range(max(args.sessions))
    ]
    print(
        f"model {model_dir.name} ({params / 1e6:.1f}M params); sessions {args.sessions}, {args.turns} turns, "
        f"{args.min_user_tokens}-{args.max_user_tokens}-token user messages, max_tokens {args.max_tokens}; "
        f"soak {args.soak:.0f}s x {args.soak_sessions} sessions; cache {args.cache_mib} MiB; "
        f"prefill chunk {cfg.prefill_chunk}; "
        f"{info['cores']} cores, torch {info['torch']} ({threads} threads)",
        flush=True,
    )

    phases, soak = [], None
    with C.ServerProcess(model_dir, "bench", *serve_flags(cfg), threads=threads) as srv:
        server_rss_healthy = C.pid_rss_bytes(srv.proc.pid)  # model loaded, nothing served yet
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
        client = AsyncOpenAI(
            base_url=srv.base_url + "/v1",
            api_key="x",
            max_retries=0,
            timeout=args.request_timeout,
            http_client=httpx.AsyncClient(limits=limits, timeout=args.request_timeout),
        )
        async with httpx.AsyncClient(base_url=srv.base_url, timeout=60) as http:
            # warm-up (allocator, kernels, HTTP stack, a batched decode pass); not measured
            warm = Conversation(tok, system, 1, 999_999, 20, 40)
            await asyncio.gather(*(run_session(client, "bench", warm, 1, 4, [], []) for _ in range(2)))
            for n in args.sessions:
                p = await load_phase(client, http, "bench", n, convs, args)
                phases.append(p)
                print(
                    f"  N={n}: {p['requests']} requests, {p['output_tokens']} tokens in {p['wall_s']:.1f}s "
                    f"({p['output_tok_s']:.1f} tok/s, decode {C.fmt_ratio(p['decode_tok_s'], 1)} tok/s), "
                    f"TTFT p50 {_ms(p['ttft_p50'])} ms, errors {p['errors']}, bg CPU {C.fmt_pct(p['others_busy'])}",
                    flush=True,
                )
            if args.soak > 0:
                await http.delete("/v1/cache")
                soak = await soak_phase(client, http, "bench", tok, system, args, srv.proc.pid)
                print(
                    f"  soak: {soak['requests']} requests in {soak['wall_s']:.0f}s, failures {soak['failures']}, "
                    f"RSS {soak['rss_start'] / 2**20:.0f} -> max {soak['rss_max'] / 2**20:.0f} -> end "
                    f"{soak['rss_end'] / 2**20:.0f} MiB",
                    flush=True,
                )
            # after the load: is the engine idle (no leaked runs, no busy stepping)?
            idle0 = await scrape(http)
            await asyncio.sleep(2.0)
            idle1 = await scrape(http)
            idle = {
                "steps_in_2s": delta(idle0, idle1, "hyserve_runtime_lock_hold_seconds_count", op="step"),
                "running": _sum(idle1, "hyserve_requests_running"),
                "waiting": _sum(idle1, "hyserve_requests_waiting"),
            }
        await client.close()
    probe = []  # the server process has exited: the probe has the cores to itself
    if args.probe_ctx > 0:
        probe = decode_probe(cfg, sorted(set(args.sessions)), args.probe_ctx)

    by_n = {p["sessions"]: p for p in phases}
    lo, hi = min(by_n), max(by_n)
    ratio = None
    if lo != hi and by_n[lo]["decode_tok_s"] and by_n[hi]["decode_tok_s"]:
        ratio = {
            "from": lo,
            "to": hi,
            "decode": by_n[hi]["decode_tok_s"] / by_n[lo]["decode_tok_s"],
            "output": by_n[hi]["output_tok_s"] / by_n[lo]["output_tok_s"],
            "pass": (
                by_n[hi]["decode_pass_tok_s"] / by_n[lo]["decode_pass_tok_s"]
                if by_n[hi].get("decode_pass_tok_s") and by_n[lo].get("decode_pass_tok_s")
                else None
            ),
            "steady": (
                by_n[hi]["steady_decode_tok_s"] / by_n[lo]["steady_decode_tok_s"]
                if by_n[hi].get("steady_decode_tok_s") and by_n[lo].get("steady_decode_tok_s")
                else None
            ),
            "target": TARGET_DECODE_RATIO,
        }
    consistency = reply_consistency(phases)
    print()
    print(load_table(phases))
    if ratio:
        ok = "meets" if ratio["decode"] >= TARGET_DECODE_RATIO else "MISSES"
        print(
            f"\ndecode tok/s N={hi} / N={lo} = {ratio['decode']:.2f}x ({ok} the >= {TARGET_DECODE_RATIO:.0f}x "
            f"target); output tok/s N={hi} / N={lo} = {ratio['output']:.2f}x"
            + (f"; steady decode tok/s N={hi} / N={lo} = {ratio['steady']:.2f}x" if ratio["steady"] else "")
            + (f"; decode-pass tok/s N={hi} / N={lo} = {ratio['pass']:.2f}x" if ratio["pass"] else "")
        )
    print(
        f"replies identical to the first phase that ran the same session: {consistency['equal_turns']}/"
        f"{consistency['compared_turns']} turns compared"
    )
    print(
        f"engine after the load: {idle['steps_in_2s']:.0f} steps in 2 s idle, running {idle['running']:.0f}, "
        f"waiting {idle['waiting']:.0f}"
    )
    if soak:
        print()
        print(soak_table(soak))
    if probe:
        print("\ndecode-step probe (one token for N live states, no HTTP, no prefill):")
        print(probe_table(probe))
        if len(probe) > 1:
            print(
                f"probe batched tok/s N={probe[-1]['n']} / N={probe[0]['n']} = "
                f"{probe[-1]['batched_tok_s'] / probe[0]['batched_tok_s']:.2f}x"
            )
    failures = sum(p["errors"] for p in phases) + (soak["failures"] if soak else 0)
    for p in phases:
        for m in p["error_messages"]:
            print(f"ERROR N={p['sessions']}: {m}", file=sys.stderr)
    for m in (soak or {}).get("error_messages", []):
        print(f"ERROR soak: {m}", file=sys.stderr)

    result = {
        "command": "python " + " ".join([os.path.relpath(__file__, Path.cwd())] + sys.argv[1:]),
        "mode": "quick" if args.quick else "full",
        "machine": info,
        "model": model_dir.name,
        "params": params,
        "config": {k: v for k, v in vars(args).items()},
        "server_rss_healthy": server_rss_healthy,
        "phases": [{k: v for k, v in p.items() if k != "replies"} for p in phases],
        "ratio": ratio,
        "reply_consistency": consistency,
        "soak": soak,
        "idle_after_load": idle,
        "decode_probe": probe,
        "probe_table": probe_table(probe) if probe else None,
        "total_seconds": time.perf_counter() - t_start,
        "failures": failures,
        "load_table": load_table(phases),
        "soak_table": soak_table(soak) if soak else None,
    }
    if args.json_out:
        out = Path(args.json_out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1, default=str))
        print(f"\nwrote {out} ({result['total_seconds']:.0f}s total)")
    return 1 if failures else 0


def main(argv=None) -> int:
    return asyncio.run(amain(parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())

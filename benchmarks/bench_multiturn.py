"""Multi-turn chat over real HTTP: cache ON vs cache OFF in one run, plus a bare-loop floor.

One conversation (system prompt + N long user turns, short greedy replies) is sent turn by turn to two
hyserve servers on loopback that load the same model folder: one with the prefix cache on, one with it
off. Each server is a `hyserve serve` process of its own, as users run it (in this process, the timing
client's thread would have to win the interpreter lock from the server's model thread to read its first
chunk). Time to first token is measured client-side in
streaming mode (time from sending the request to the
first content chunk), by default with a plain `httpx` client (`--client httpx`): the `openai` client's
own work on a 4k-token request (building and validating the request, parsing each chunk into pydantic
objects) adds milliseconds that are not the server's, so after the repeats both clients send the last
turn alternately and the difference is reported (`client_overhead` in the JSON). Both servers get token-
identical prompts: the history always carries the cache-ON server's reply, exactly as a chat client
would send it back.

The "bare loop" is the least work any server must do for the same warm turn: restore a snapshot of the
history state the cache-ON server restored (built here, in this process, from the same tokens), run the
new suffix through the model, take the argmax. `on/bare` = server warm TTFT / bare loop; the target is
<= 1.3. The servers are idle while it runs.

    python benchmarks/bench_multiturn.py            # bench-size qwen3_5, 8 turns, ~4k tokens at turn 8
    python benchmarks/bench_multiturn.py --quick    # tiny model, 3 turns, < 1 minute
    python benchmarks/bench_multiturn.py --json benchmarks/results/multiturn.json
    python benchmarks/bench_multiturn.py --split-server ...   # also a cache-on server that defers checkpoints

`--split-server` adds a third server, cache on with `--defer-checkpoints`: it leaves the history boundary a
few tokens before the end of a warm prompt to a job after the reply instead of taking it inside the prefill
(the default). Its TTFT column shows what deferring saves (on models that must split the prefill there).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common as C  # noqa: E402

TARGET_RATIO = 1.3
TTFT_SUM = "hyserve_time_to_first_token_seconds_sum"  # the engine's own TTFT, summed over requests


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny model, 3 turns, small prompts (< 1 minute)")
    p.add_argument("--turns", type=int, default=None, help="conversation turns (default 8; quick 3)")
    p.add_argument(
        "--target-tokens", type=int, default=None, help="prompt tokens at the last turn (default 4000; quick 600)"
    )
    p.add_argument("--max-tokens", type=int, default=16, help="reply length per turn")
    p.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="times the whole conversation is replayed (cache cleared in between); per-turn "
        "timings are medians (default 3; quick 1)",
    )
    p.add_argument("--arch", default="qwen3_5", help="model family (default qwen3_5)")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default 2)")
    p.add_argument(
        "--budget", type=float, default=660.0, help="seconds; no further repeat starts once the run would exceed this"
    )
    p.add_argument(
        "--wait-quiet",
        type=float,
        default=None,
        help="before each repeat, wait up to this many seconds for other processes to go quiet (default 30; quick 0)",
    )
    p.add_argument(
        "--extra-repeats",
        type=int,
        default=None,
        help="further repeats allowed when a repeat ran on a busy machine (default 3; quick 0); the "
        "quietest --repeats repeats are reported",
    )
    p.add_argument(
        "--busy-threshold",
        type=float,
        default=0.15,
        help="a repeat counts as quiet when other processes used at most this share of the CPU",
    )
    p.add_argument("--json", dest="json_out", default=None, help="write all measurements to this JSON file")
    p.add_argument("--check", action="store_true", help="exit 1 if the warm on/bare ratio misses the target")
    p.add_argument(
        "--split-server",
        action="store_true",
        help="also time a cache-on server that splits the prefill at every boundary (no deferral)",
    )
    p.add_argument(
        "--client",
        choices=("httpx", "openai"),
        default="httpx",
        help="client that times the turns (default httpx; see the module docstring)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--final-tokens",
        type=int,
        default=None,
        help="make the last user message this many tokens (e.g. 64: a short turn after a long history)",
    )
    args = p.parse_args(argv)
    args.turns = args.turns or (3 if args.quick else 8)
    args.target_tokens = args.target_tokens or (600 if args.quick else 4000)
    args.repeats = args.repeats or (1 if args.quick else 3)
    if args.extra_repeats is None:
        args.extra_repeats = 0 if args.quick else 3
    if args.wait_quiet is None:
        args.wait_quiet = 0.0 if args.quick else 30.0
    return args


def build_conversation(
    tokenizer,
    turns: int,
    target_tokens: int,
    max_tokens: int,
    seed: int,
    final_tokens: int | None = None,
    user_tokens: int | None = None,
):
    rng = random.Random(seed)
    system = C.text_of_tokens(tokenizer, rng, 48)
    system = "You are a helpful assistant. " + system
    sys_tokens = len(tokenizer.encode(system))
    overhead = 12  # chat-template tokens per user+assistant pair, roughly
    if user_tokens:
        sizes = [user_tokens] * turns
    elif final_tokens:
        per_turn = max(16, (target_tokens - sys_tokens - final_tokens) // max(1, turns - 1) - max_tokens - overhead)
        sizes = [per_turn] * (turns - 1) + [final_tokens]
    else:
        per_turn = max(16, (target_tokens - sys_tokens) // turns - max_tokens - overhead)
        sizes = [per_turn] * turns
    users = [f"Turn {t + 1}. " + C.text_of_tokens(tokenizer, rng, n) for t, n in enumerate(sizes)]
    return system, users


def stream_chat(client, model: str, messages: list[dict], max_tokens: int, template_kwargs: dict | None = None) -> dict:
    """One streamed greedy request: TTFT (first generated text, answer or reasoning), the answer, usage."""
    t0 = time.perf_counter()
    extra = {"chat_template_kwargs": template_kwargs} if template_kwargs else None
    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=extra,
    )
    ttft, parts, usage = None, [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            d = choice.delta
            # the first chunk only announces the role; the next one carries the first generated token
            text = (
                None
                if d is None
                else (d.content if d.content is not None else (d.model_extra or {}).get("reasoning_content"))
            )
            first = (d is not None and d.role is None and text is not None) or choice.finish_reason
            if ttft is None and first:
                ttft = time.perf_counter() - t0
            if d is not None and d.content:
                parts.append(d.content)
    total = time.perf_counter() - t0
    details = getattr(usage, "prompt_tokens_details", None)
    return {
        "ttft": ttft,
        "total": total,
        "text": "".join(parts),
        "prompt_tokens": usage.prompt_tokens if usage else None,
        "cached_tokens": (details.cached_tokens if details else 0) if usage else None,
        "completion_tokens": usage.completion_tokens if usage else None,
    }


def stream_chat_http(http, base_url: str, model: str, messages: list[dict], max_tokens: int) -> dict:
    """`stream_chat` with a plain httpx client: the request body is serialized inside the timed span, the
    SSE lines are parsed with `json.loads`."""
    t0 = time.perf_counter()
    body = json.dumps(
        {
            "model": model,
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )
    ttft, parts, usage = None, [], None
    with http.stream(
        "POST", f"{base_url}/v1/chat/completions", content=body, headers={"content-type": "application/json"}
    ) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            chunk = json.loads(line[5:])
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices", []):
                d = choice.get("delta") or {}
                first = ("role" not in d and d.get("content") is not None) or choice.get("finish_reason")
                if ttft is None and first:
                    ttft = time.perf_counter() - t0
                if d.get("content"):
                    parts.append(d["content"])
    total = time.perf_counter() - t0
    details = (usage or {}).get("prompt_tokens_details") or {}
    return {
        "ttft": ttft,
        "total": total,
        "text": "".join(parts),
        "prompt_tokens": usage["prompt_tokens"] if usage else None,
        "cached_tokens": details.get("cached_tokens", 0) if usage else None,
        "completion_tokens": usage["completion_tokens"] if usage else None,
    }


def history_snapshot(rt, prompt: list[int], cached: int, chunk: int, memo: dict):
    """A snapshot of the state after prompt[:cached], built once per token sequence (on the model thread)."""
    key = tuple(prompt[:cached])
    if key not in memo:
        ad = rt.adapter
        st = ad.new_state()
        for i in range(0, cached, chunk):
            ad.forward(st, prompt[i : min(cached, i + chunk)])
        memo[key] = ad.snapshot(st)
    return memo[key]


def bare_loop(rt, prompt: list[int], cached: int, chunk: int = 512, memo: dict | None = None) -> float:
    """Seconds for restore(history snapshot) + prefill of prompt[cached:] + argmax: the floor for a warm TTFT.
    Runs on hyserve's model thread, as a server's own model work does (see hyserve.model_thread)."""
    from hyserve import model_thread

    return model_thread.run(_bare_loop, rt, prompt, cached, chunk, {} if memo is None else memo)


def _bare_loop(rt, prompt: list[int], cached: int, chunk: int, memo: dict) -> float:
    import torch

    ad = rt.adapter
    snap = history_snapshot(rt, prompt, cached, chunk, memo) if cached else None
    t0 = time.perf_counter()
    st = ad.restore(snap, prompt[:cached]) if snap is not None else ad.new_state()
    logits = None
    pos = cached
    while pos < len(prompt):
        end = min(len(prompt), pos + chunk)
        logits = ad.forward(st, prompt[pos:end])
        pos = end
    int(torch.argmax(logits))
    return time.perf_counter() - t0


def turn_table(summary: list[dict]) -> str:
    """Per-turn medians (the JSON's `turns`); with the columns of the inline server when it ran."""
    headers = [
        "turn",
        "prompt tok",
        "cached tok",
        "cached/prior",
        "TTFT off (s)",
        "TTFT on (s)",
        "speedup",
        "bare loop (s)",
        "on/bare",
        "bg CPU",
    ]
    rows = [
        [
            s["turn"],
            s["prompt_tokens"],
            s["cached_tokens"],
            C.fmt_ratio(s["cached_ratio"], 3),
            C.fmt_s(s["ttft_off"]),
            C.fmt_s(s["ttft_on"]),
            C.fmt_ratio(s["speedup"]) + "x",
            C.fmt_s(s["bare"]),
            C.fmt_ratio(s["on_over_bare"]),
            C.fmt_pct(s["others_busy"]),
        ]
        for s in summary
    ]
    if any("ttft_split" in s for s in summary):
        headers[6:6] = ["TTFT on, split inline (s)", "split / on"]
        for row, s in zip(rows, summary):
            row[6:6] = [C.fmt_s(s["ttft_split"]), C.fmt_ratio(s["ttft_split"] / s["ttft_on"] if s["ttft_on"] else None)]
    return C.table(headers, rows)


def _busy(rows: list[dict]) -> float:
    """Mean share of the CPU other processes used during one replay of the conversation."""
    return C.mean(r[k]["others_busy"] for r in rows for k in ("on", "off")) or 0.0


def main(argv=None) -> int:
    args = parse_args(argv)
    threads = C.setup_torch(args.threads)
    C.warn_if_busy()
    import httpx
    from openai import OpenAI

    from hyserve.models.runtime import ModelRuntime

    size = "tiny" if args.quick else "bench"
    model_dir = C.ensure_model(args.arch, size)
    name = f"{size}-{args.arch}"
    t_start = time.perf_counter()
    flags = {"on": [], "off": ["--no-cache"]}
    if args.split_server:
        flags["split"] = ["--defer-checkpoints"]  # leaves short-tail boundaries to a job after the reply
    rt = ModelRuntime.load(model_dir, device="cpu")  # this process's own: prompts and the bare loop
    tok = rt.tokenizer
    system, users = build_conversation(
        tok, args.turns, args.target_tokens, args.max_tokens, args.seed, args.final_tokens
    )
    info = C.machine_info()
    info["torch_threads"] = threads
    print(
        f"model {name} ({sum(p.numel() for p in rt.model.parameters()) / 1e6:.1f}M params), "
        f"{args.turns} turns, ~{args.target_tokens} prompt tokens at the last turn, {args.max_tokens}-token "
        f"replies, {args.repeats} repeat(s); {info['cores']} cores, torch {info['torch']} "
        f"({threads} threads), transformers {info['transformers']}",
        flush=True,
    )

    replies: list[str] = []
    runs: list[list[dict]] = []
    memo: dict = {}  # history snapshots of the bare loop, by tokens
    with contextlib.ExitStack() as stack:
        servers, send = {}, {}
        http = stack.enter_context(httpx.Client(timeout=900))
        for key, extra in flags.items():
            srv = stack.enter_context(
                C.ServerProcess(
                    model_dir,
                    name,
                    "--cache-bytes",
                    str(2 << 30),
                    *extra,
                    threads=threads,
                    idle_limit=60.0 if args.quick else 900.0,
                )
            )
            servers[key] = srv
            client = OpenAI(base_url=f"{srv.base_url}/v1", api_key="unused", max_retries=0, timeout=900)
            send[key] = {
                "openai": functools.partial(stream_chat, client, name),
                "httpx": functools.partial(stream_chat_http, http, srv.base_url, name),
            }
        # warm-up: first-call overheads (allocator, kernels, HTTP stack) stay out of turn 1
        warm = [{"role": "system", "content": "warm-up"}, {"role": "user", "content": users[0][:200]}]
        for key in servers:
            for fn in send[key].values():
                fn(warm, 4)
            servers[key].wait_idle()
        bare_loop(rt, rt.render_chat(warm, True), 0)

        for rep in range(args.repeats + args.extra_repeats):
            quiet_runs = [r for r in runs if _busy(r) <= args.busy_threshold]
            if len(quiet_runs) >= args.repeats:
                break
            elapsed = time.perf_counter() - t_start
            if rep and elapsed / rep * (rep + 1) > args.budget:
                print(f"stopping after {rep} repeat(s): time budget {args.budget:.0f}s", flush=True)
                break
            if rep >= args.repeats:
                print(
                    f"  {len(runs) - len(quiet_runs)} repeat(s) ran while other processes used more than "
                    f"{args.busy_threshold:.0%} of the CPU: one more",
                    flush=True,
                )
            quiet = C.wait_for_quiet(args.wait_quiet) if args.wait_quiet > 0 else {}
            for srv in servers.values():
                srv.clear_cache()
            messages = [{"role": "system", "content": system}]
            rows = []
            for t in range(args.turns):
                messages.append({"role": "user", "content": users[t]})
                prompt = rt.render_chat(messages, True)
                prior = len(rt.render_chat(messages[:-1], False)) if t else 0
                row = {
                    "turn": t + 1,
                    "prompt_tokens": len(prompt),
                    "prior_history_tokens": prior,
                    "waited_for_quiet": quiet.get("waited") if t == 0 else None,
                }
                keys = list(servers)
                order = keys[t % len(keys) :] + keys[: t % len(keys)]  # rotate who goes first
                for key in order:
                    srv = servers[key]
                    before = srv.metric(TTFT_SUM)
                    mon = C.CpuMonitor()
                    r = send[key][args.client](messages, args.max_tokens)
                    r["others_busy"] = mon.stop()
                    r["server_ttft"] = srv.metric(TTFT_SUM) - before
                    # idle-time work the request left behind (the rebuild of a re-rendered reply) finishes
                    # before anything else is timed, as it would while a user reads the reply
                    r["idle_wait"] = srv.wait_idle()
                    row[key] = r
                if row["on"]["prompt_tokens"] != len(prompt):
                    raise RuntimeError(f"server saw {row['on']['prompt_tokens']} prompt tokens, expected {len(prompt)}")
                row["bare"] = bare_loop(rt, prompt, row["on"]["cached_tokens"], memo=memo)
                row["cache_bytes"] = servers["on"].cache_stats()["bytes"]
                row["replies_equal"] = row["on"]["text"] == row["off"]["text"]
                if rep == 0:
                    replies.append(row["on"]["text"])
                messages.append({"role": "assistant", "content": replies[t]})
                rows.append(row)
                print(
                    f"  repeat {rep + 1} turn {t + 1}: prompt {len(prompt)} cached {row['on']['cached_tokens']} "
                    f"ttft off {row['off']['ttft']:.3f}s on {row['on']['ttft']:.3f}s bare {row['bare']:.3f}s",
                    flush=True,
                )
            runs.append(rows)
        # the client library's own cost: the last turn again, through each client alternately (the server
        # does the same work for both: the cache already holds this prompt's history)
        overhead = {"openai": [], "httpx": []}
        for _ in range(5):
            for kind in overhead:
                overhead[kind].append(send["on"][kind](messages[:-1], args.max_tokens)["ttft"])
                servers["on"].wait_idle()
        client_overhead = {k: C.median(v) for k, v in overhead.items()}

    # -- per-turn medians over the quietest `repeats` repeats -------------------------------------
    all_runs = runs
    runs = sorted(runs, key=_busy)[: args.repeats]
    runs.sort(key=lambda rows: all_runs.index(rows))
    summary = []
    for t in range(args.turns):
        per = [rows[t] for rows in runs]
        first = per[0]
        s = {
            "turn": t + 1,
            "prompt_tokens": first["prompt_tokens"],
            "cached_tokens": first["on"]["cached_tokens"],
            "prior_history_tokens": first["prior_history_tokens"],
            "ttft_off": C.median(r["off"]["ttft"] for r in per),
            "ttft_on": C.median(r["on"]["ttft"] for r in per),
            "server_ttft_off": C.median(r["off"]["server_ttft"] for r in per),
            "server_ttft_on": C.median(r["on"]["server_ttft"] for r in per),
            "bare": C.median(r["bare"] for r in per),
            "ttft_off_min": min(r["off"]["ttft"] for r in per),
            "ttft_on_min": min(r["on"]["ttft"] for r in per),
            "bare_min": min(r["bare"] for r in per),
            "cache_bytes": first["cache_bytes"],
            "replies_equal": all(r["replies_equal"] for r in per),
            "others_busy": C.mean(r[k]["others_busy"] for r in per for k in ("on", "off")),
        }
        if args.split_server:
            s["ttft_split"] = C.median(r["split"]["ttft"] for r in per)
            s["cached_split"] = first["split"]["cached_tokens"]
        s["cached_ratio"] = s["cached_tokens"] / s["prior_history_tokens"] if s["prior_history_tokens"] else None
        s["speedup"] = s["ttft_off"] / s["ttft_on"] if s["ttft_on"] else None
        s["on_over_bare"] = s["ttft_on"] / s["bare"] if s["bare"] else None
        summary.append(s)

    print()
    print(turn_table(summary))
    print("bg CPU = share of the machine's CPU used by other processes during that turn's requests (0% = quiet)")
    warm = [s for s in summary if s["turn"] > 1 and s["cached_tokens"]]
    result = {
        "args": vars(args),
        "machine": info,
        "model": name,
        "turns": summary,
        "runs": all_runs,
        "runs_used": [all_runs.index(r) + 1 for r in runs],
        "runs_bg_cpu": [round(_busy(r), 3) for r in all_runs],
    }
    verdict = None
    if warm:
        agg = sum(s["ttft_on"] for s in warm) / sum(s["bare"] for s in warm)
        worst = max(s["on_over_bare"] for s in warm)
        speed = sum(s["ttft_off"] for s in warm) / sum(s["ttft_on"] for s in warm)
        verdict = agg <= TARGET_RATIO
        print(
            f"\nwarm turns 2..{args.turns}: TTFT speedup (sum off / sum on) {speed:.2f}x; server warm TTFT / bare "
            f"loop = {agg:.2f} aggregate, {worst:.2f} worst turn (target <= {TARGET_RATIO}: "
            f"{'met' if verdict else 'NOT met'})"
        )
        result["warm"] = {
            "speedup": speed,
            "on_over_bare": agg,
            "on_over_bare_worst": worst,
            "target": TARGET_RATIO,
            "target_met": verdict,
        }
    result["client"] = args.client
    result["client_overhead"] = client_overhead
    print(
        f"last turn again, medians of 5 each: TTFT {client_overhead['httpx'] * 1e3:.1f} ms with httpx, "
        f"{client_overhead['openai'] * 1e3:.1f} ms with the openai client (turns above timed with {args.client})"
    )
    eq = sum(s["replies_equal"] for s in summary)
    print(
        f"greedy replies identical with cache on and off: {eq}/{len(summary)} turns; "
        f"cache holds {summary[-1]['cache_bytes'] / 2**20:.1f} MiB after the last turn; "
        f"medians over repeat(s) {[all_runs.index(r) + 1 for r in runs]} of {len(all_runs)} (bg CPU per repeat "
        f"{[f'{_busy(r):.0%}' for r in all_runs]}), wall time {time.perf_counter() - t_start:.0f}s; "
        f"load average {info['loadavg_start']} at start"
    )
    info["loadavg_end"] = C._loadavg()
    if args.json_out:
        out = Path(args.json_out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2))
        print(f"wrote {out}")
    if args.check and verdict is False:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

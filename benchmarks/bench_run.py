"""Workload x system benchmark for hyserve's exact-state prefix cache (in-process, no HTTP).

Workloads (each a list of conversations whose user messages are fixed up front):
  chat      growing multi-turn chat: long user turns, short replies, history grows every turn
  sysprompt many conversations that share one long system prompt (one question each)
  agent     agent-style turns: the user resends a whole (slightly edited) source file every turn and
            gets a diff-sized reply back
  short     many short turns, every new user message under 64 tokens
  longshort two long turns (~4k tokens of history), then a short one: the headline warm turn

Systems, all greedy and measured in the same run on the same model folder:
  hyserve-on    hyserve engine, prefix cache on, default policy (system, history, post-decode checkpoints)
  hyserve-off   hyserve engine, prefix cache off: every turn prefills the whole prompt
  hf-generate   plain transformers `model.generate()` on the full prompt every turn, in a process of its
                own without hyserve's kernels or denormal flushing (TTFT via a streamer)
  block-528     hyserve with CheckpointPolicy(block_size=528): checkpoints only at multiples of 528
                tokens, like vLLM's block-grid hybrid cache
  block-64      the same with 64-token blocks

Conversations are replayed token-identically for every system: the assistant turns in the history are
the replies the first system in the list (hyserve-on by default) produced, as a chat client would send
them back. The hyserve systems are driven through `Engine.generate()`, so TTFT is engine time from
request creation to the first sampled token (it includes the policy's prompt renders, the cache
lookup/restore, prefill and the boundary snapshots, but no HTTP; benchmarks/bench_multiturn.py measures HTTP).

Per request: TTFT, prompt tokens, cached tokens, prefill tokens computed (prompt - cached), mean
inter-token latency, snapshot/restore seconds, and the cache's bytes/entries afterwards.

    python benchmarks/bench_run.py                          # bench-size qwen3_5, mamba2, qwen3 (~15-20 min)
    python benchmarks/bench_run.py --models qwen3_5         # one family
    python benchmarks/bench_run.py --models hybrids --systems hyserve-on,hyserve-off,block-528 --workloads chat,short
                                                            # the hybrid families of issue 21, bench-sized
    python benchmarks/bench_run.py --quick --out /tmp/x     # tiny models, < 2 minutes, CI smoke test

Writes results.json, summary.md and PNG plots into --out (default benchmarks/results/run-<time>/).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common as C  # noqa: E402

from hyserve.testing.tiny import ARCHS  # noqa: E402

ALL_MODELS = ("qwen3_5", "mamba2", "qwen3")
HYBRID_MODELS = (
    "qwen3_5_moe",
    "nemotron_h",
    "granitemoehybrid",
    "falcon_h1",
    "lfm2",
    "lfm2_moe",
    "jamba",
    "bamba",
    "zamba2",
)
ALL_SYSTEMS = ("hyserve-on", "hyserve-off", "hf-generate", "block-528", "block-64")
ALL_WORKLOADS = ("chat", "sysprompt", "agent", "short", "longshort")
BLOCK = 528  # vLLM's block size for Qwen3.5's hybrid cache: the headline compares prompts under it

# Workload sizes: full (bench models) and quick (tiny models, CI).
SIZES = {
    "full": {
        "chat": dict(turns=8, user_tokens=400, reply=16),
        "sysprompt": dict(conversations=5, system_tokens=1200, user_tokens=40, reply=16),
        "agent": dict(turns=4, functions=5, reply=32),
        "short": dict(turns=10, user_tokens=(12, 60), reply=16),
        "longshort": dict(long_turns=2, long_tokens=2000, short_tokens=64, reply=16),
    },
    "quick": {
        "chat": dict(turns=3, user_tokens=120, reply=6),
        "sysprompt": dict(conversations=3, system_tokens=300, user_tokens=20, reply=6),
        "agent": dict(turns=2, functions=2, reply=8),
        "short": dict(turns=3, user_tokens=(12, 60), reply=6),
        "longshort": dict(long_turns=2, long_tokens=150, short_tokens=16, reply=6),
    },
}


@dataclass
class Conversation:
    system: str | None
    users: list[str]
    max_tokens: int


@dataclass
class Workload:
    name: str
    conversations: list[Conversation]
    script: dict = field(default_factory=dict)  # (conv, turn) -> assistant reply text used in the history

    @property
    def requests(self) -> int:
        return sum(len(c.users) for c in self.conversations)


# -- workloads ---------------------------------------------------------------------------------------
def make_workloads(tokenizer, size: str, names, seed: int) -> list[Workload]:
    spec = SIZES[size]
    out = []
    for name in names:
        rng = random.Random(f"{seed}-{name}")
        s = spec[name]
        if name == "chat":
            system = "You are a helpful assistant. " + C.text_of_tokens(tokenizer, rng, 40)
            users = [
                f"Question {t + 1}: " + C.text_of_tokens(tokenizer, rng, s["user_tokens"]) for t in range(s["turns"])
            ]
            convs = [Conversation(system, users, s["reply"])]
        elif name == "sysprompt":
            system = "You are the support assistant of a travel company. Follow these rules. " + C.text_of_tokens(
                tokenizer, rng, s["system_tokens"]
            )
            convs = [
                Conversation(system, [C.text_of_tokens(tokenizer, rng, s["user_tokens"]) + "?"], s["reply"])
                for _ in range(s["conversations"])
            ]
        elif name == "agent":
            lines = C.code_file(rng, s["functions"])
            users = []
            for t in range(s["turns"]):
                ask = C.text_of_tokens(tokenizer, rng, 24)
                users.append(
                    "Here is the current content of utils.py:\n```python\n"
                    + "\n".join(lines)
                    + f"\n```\nPlease reply with a unified diff only. Task: {ask}."
                )
                # the client applies the diff it got back: a changed constant and one added line
                i = rng.randrange(4, len(lines))
                lines[i] = lines[i].replace("scale", f"scale_{t}") if "scale" in lines[i] else lines[i]
                lines.insert(rng.randrange(4, len(lines)), f"# edited in step {t + 1}")
            system = "You are a coding agent. You edit files by replying with unified diffs."
            convs = [Conversation(system, users, s["reply"])]
        elif name == "short":
            lo, hi = s["user_tokens"]
            users = [C.text_of_tokens(tokenizer, rng, rng.randint(lo, hi)) for _ in range(s["turns"])]
            convs = [Conversation("You are a helpful assistant.", users, s["reply"])]
        elif name == "longshort":
            users = [
                f"Part {t + 1}: " + C.text_of_tokens(tokenizer, rng, s["long_tokens"]) for t in range(s["long_turns"])
            ]
            users.append(C.text_of_tokens(tokenizer, rng, s["short_tokens"]))
            convs = [Conversation("You are a helpful assistant.", users, s["reply"])]
        else:
            raise ValueError(f"unknown workload {name!r}")
        out.append(Workload(name, convs))
    return out


# -- systems -----------------------------------------------------------------------------------------
def _sample(registry, name: str) -> float:
    return registry.get_sample_value(name) or 0.0


def wait_idle(engine, limit: float = 30.0) -> float:
    """Seconds until the engine has no queued, running or background work (e.g. the idle-time rebuild of a
    re-rendered reply), like a client that reads the reply before sending its next turn. Not part of TTFT."""
    t0 = time.perf_counter()
    while not getattr(engine, "idle", True) and time.perf_counter() - t0 < limit:
        time.sleep(0.002)
    return time.perf_counter() - t0


class HyserveSystem:
    def __init__(self, name: str, model_dir: Path, cache_enabled: bool, block_size: int | None, cache_bytes: int):
        from hyserve.cache.policy import CheckpointPolicy
        from hyserve.service import ServiceConfig, build_service

        self.name = name
        policy = CheckpointPolicy(block_size=block_size) if block_size else CheckpointPolicy()
        self.service = build_service(
            ServiceConfig(
                model_dir=model_dir,
                served_model_name=name,
                device="cpu",
                cache_enabled=cache_enabled,
                cache_bytes=cache_bytes,
                policy=policy,
            )
        )

    @property
    def tokenizer(self):
        return self.service.runtime.tokenizer

    def reset(self) -> None:
        with self.service.runtime.lock:
            self.service.cache.clear()

    def close(self) -> None:
        stop = getattr(self.service.engine, "stop", None)  # lets the worker thread (and the model) go
        if stop is not None:
            stop()

    def _metrics(self) -> dict:
        r = self.service.metrics.registry
        return {
            k: _sample(r, n)
            for k, n in (
                ("itl_sum", "hyserve_inter_token_latency_seconds_sum"),
                ("itl_count", "hyserve_inter_token_latency_seconds_count"),
                ("restore", "hyserve_cache_restore_seconds_sum"),
                ("snapshot", "hyserve_cache_snapshot_seconds_sum"),
                ("snapshots", "hyserve_cache_snapshot_seconds_count"),
            )
        }

    def run(self, messages: list[dict], max_tokens: int) -> dict:
        from hyserve.engine import GenerationRequest
        from hyserve.engine.sampling import SamplingParams

        rt = self.service.runtime
        prompt = rt.render_chat(messages, True)
        before = self._metrics()
        t0 = time.perf_counter()
        req = GenerationRequest(
            prompt=prompt, max_tokens=max_tokens, messages=messages, sampling=SamplingParams(temperature=0)
        )
        fin = self.service.engine.generate(req)
        total = time.perf_counter() - t0
        idle_wait = wait_idle(self.service.engine)
        after = self._metrics()
        d = {k: after[k] - before[k] for k in after}
        stats = self.service.cache.stats()
        return {
            "prompt_tokens": fin.prompt_tokens,
            "cached_tokens": fin.cached_tokens,
            "prefill_tokens": fin.prompt_tokens - fin.cached_tokens,
            "generated": len(fin.token_ids),
            "ttft": fin.ttft,
            "total": total,
            "itl": d["itl_sum"] / d["itl_count"] if d["itl_count"] else None,
            "restore_s": d["restore"],
            "snapshot_s": d["snapshot"],
            "snapshots": int(d["snapshots"]),
            "cache_bytes": stats["bytes"],
            "cache_entries": stats["entries"],
            "text": fin.text,
            "idle_wait": idle_wait,
        }


class HFGenerateSystem:
    """Plain transformers as its users run it: `model.generate()` over the full prompt every turn, nothing
    reused, in a process of its own. In this process the model thread flushes denormals and runs
    hyserve's kernels (hyserve.kernels), which a transformers user does not get; the child process
    runs transformers' own functions on its main thread (the first torch thread: no OpenMP slowdown),
    with the same number of threads. The parent waits while the child works."""

    name = "hf-generate"

    def __init__(self, model_dir: Path):
        import multiprocessing

        import torch
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)  # for the workloads' counts
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=_hf_worker, args=(child, str(model_dir), torch.get_num_threads()), name="hf-generate", daemon=True
        )
        self.proc.start()
        child.close()
        self._answer()  # "ready" once the model is loaded

    def _answer(self):
        reply = self.conn.recv()
        if isinstance(reply, BaseException):
            raise reply
        return reply

    def reset(self) -> None:
        pass

    def close(self) -> None:
        if self.proc.is_alive():
            self.conn.send(None)
            self.proc.join(30)
        self.conn.close()

    def run(self, messages: list[dict], max_tokens: int) -> dict:
        self.conn.send((messages, max_tokens))
        return self._answer()


def _hf_worker(conn, model_dir: str, threads: int) -> None:
    """The child process of HFGenerateSystem: load the model, then answer requests until told to stop."""
    try:
        C.setup_torch(threads)
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True).eval()
        tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        conn.send("ready")
    except Exception as exc:  # the parent re-raises it
        conn.send(RuntimeError(f"hf-generate worker failed to start: {exc!r}"))
        return
    while (item := conn.recv()) is not None:
        try:
            conn.send(_hf_generate(model, tokenizer, *item))
        except Exception as exc:
            conn.send(RuntimeError(f"hf-generate failed: {exc!r}"))


def _hf_generate(model, tokenizer, messages: list[dict], max_tokens: int) -> dict:
    import torch
    from transformers.generation.streamers import BaseStreamer

    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    prompt = tokenizer.encode(text, add_special_tokens=False)

    class Stamps(BaseStreamer):
        def __init__(self):
            self.calls, self.times = 0, []

        def put(self, value):
            self.calls += 1
            if self.calls > 1:  # the first call hands over the prompt itself
                self.times.append(time.perf_counter())

        def end(self):
            pass

    stamps = Stamps()
    ids = torch.tensor([prompt])
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_tokens,
            do_sample=False,
            streamer=stamps,
        )
    total = time.perf_counter() - t0
    new = out[0, len(prompt) :].tolist()
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    while new and new[-1] in eos:
        new.pop()
    gaps = [b - a for a, b in zip(stamps.times, stamps.times[1:])]
    return {
        "prompt_tokens": len(prompt),
        "cached_tokens": 0,
        "prefill_tokens": len(prompt),
        "generated": len(out[0]) - len(prompt),
        "ttft": (stamps.times[0] - t0) if stamps.times else total,
        "total": total,
        "itl": sum(gaps) / len(gaps) if gaps else None,
        "restore_s": 0.0,
        "snapshot_s": 0.0,
        "snapshots": 0,
        "cache_bytes": 0,
        "cache_entries": 0,
        "text": tokenizer.decode(new, skip_special_tokens=True),
    }


def make_system(name: str, model_dir: Path, cache_bytes: int):
    if name == "hyserve-on":
        return HyserveSystem(name, model_dir, True, None, cache_bytes)
    if name == "hyserve-off":
        return HyserveSystem(name, model_dir, False, None, cache_bytes)
    if name == "hf-generate":
        return HFGenerateSystem(model_dir)
    if name.startswith("block-"):
        return HyserveSystem(name, model_dir, True, int(name.split("-", 1)[1]), cache_bytes)
    raise ValueError(f"unknown system {name!r}; choose from {', '.join(ALL_SYSTEMS)}")


def warm_up(system) -> None:
    """One short request so first-call overheads (allocator, lazy inits) stay out of the measurements."""
    system.run([{"role": "system", "content": "warm-up"}, {"role": "user", "content": "Hello there, how are you?"}], 3)
    system.reset()


def _render_len(tokenizer, messages: list[dict]) -> int:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    return len(tokenizer.encode(text, add_special_tokens=False))


class OutOfTime(Exception):
    pass


def run_workload(system, wl: Workload, bar, deadline: float = float("inf")) -> list[dict]:
    system.reset()
    rows, step = [], 0
    for ci, conv in enumerate(wl.conversations):
        messages = [{"role": "system", "content": conv.system}] if conv.system else []
        for ti, user in enumerate(conv.users):
            if time.perf_counter() > deadline:
                raise OutOfTime(f"{wl.name}: stopped after {step} of {wl.requests} requests")
            prior = _render_len(system.tokenizer, messages) if messages else 0
            messages.append({"role": "user", "content": user})
            mon = C.CpuMonitor()
            r = system.run(messages, conv.max_tokens)
            r["others_busy"] = mon.stop()
            step += 1
            key = (ci, ti)
            if key not in wl.script:
                wl.script[key] = r["text"]
            messages.append({"role": "assistant", "content": wl.script[key]})
            r.update(step=step, conversation=ci + 1, turn=ti + 1, history_tokens=prior)
            rows.append(r)
            bar.update(1)
    return rows


# -- reporting ---------------------------------------------------------------------------------------
def _speedup(rows: list[dict], ref: list[dict] | None) -> float | None:
    """Sum of hyserve-off TTFT / sum of this system's TTFT over the requests both completed."""
    n = min(len(rows), len(ref or []))
    own = sum(r["ttft"] for r in rows[:n])
    return sum(r["ttft"] for r in ref[:n]) / own if n and own else None


def summarize(rows: list[dict], ref: list[dict] | None) -> dict:
    warm = [r for r in rows if r["step"] > 1]
    ttft = sum(r["ttft"] for r in rows)
    prompt = sum(r["prompt_tokens"] for r in rows)
    cached = sum(r["cached_tokens"] for r in rows)
    itls = [r["itl"] for r in rows if r["itl"] is not None]
    return {
        "requests": len(rows),
        "ttft_sum": ttft,
        "ttft_warm_mean": sum(r["ttft"] for r in warm) / len(warm) if warm else None,
        "ttft_last": rows[-1]["ttft"] if rows else None,
        "prompt_tokens": prompt,
        "prefill_tokens": sum(r["prefill_tokens"] for r in rows),
        "cached_fraction": cached / prompt if prompt else 0.0,
        "itl_mean": sum(itls) / len(itls) if itls else None,
        "cache_bytes_max": max((r["cache_bytes"] for r in rows), default=0),
        "speedup_vs_off": _speedup(rows, ref),
        "others_busy_mean": C.mean(r.get("others_busy") for r in rows),
    }


def headline(results: dict) -> dict:
    """Per model: the last (short) turn of `longshort` per system with its speedups over hyserve-off and
    hf-generate, and the share of prior history reused by warm requests (turn 2 on: their history was
    sent before) whose prompt is under BLOCK."""
    out = {}
    for model, per_wl in results.items():
        h = {}
        ls = per_wl.get("longshort", {})
        if "hyserve-on" in ls:
            on = ls["hyserve-on"]["rows"][-1]
            h["longshort_last"] = {
                name: {
                    "ttft": d["rows"][-1]["ttft"],
                    "prompt_tokens": d["rows"][-1]["prompt_tokens"],
                    "cached_tokens": d["rows"][-1]["cached_tokens"],
                    "history_tokens": d["rows"][-1]["history_tokens"],
                    "ttft_over_on": d["rows"][-1]["ttft"] / on["ttft"],
                }
                for name, d in ls.items()
                if len(d["rows"]) == len(ls["hyserve-on"]["rows"])
            }
        short = {}
        for name in {n for per_sys in per_wl.values() for n in per_sys}:
            rows = [
                r
                for per_sys in per_wl.values()
                for r in per_sys.get(name, {}).get("rows", [])
                if r["prompt_tokens"] < BLOCK and r["turn"] > 1
            ]
            hist = sum(r["history_tokens"] for r in rows)
            if rows:
                short[name] = {
                    "requests": len(rows),
                    "history_tokens": hist,
                    "cached_tokens": sum(min(r["cached_tokens"], r["history_tokens"]) for r in rows),
                    "reuse": sum(min(r["cached_tokens"], r["history_tokens"]) for r in rows) / hist,
                }
        h["under_block_reuse"] = short
        out[model] = h
    return out


def headline_tables(head: dict) -> str:
    parts = []
    for model, h in head.items():
        last = h.get("longshort_last")
        if last:
            on = last["hyserve-on"]
            parts.append(
                f"**{model}: a short turn after a long history** ({on['history_tokens']} history tokens, "
                f"{on['prompt_tokens'] - on['history_tokens']} new)\n"
            )
            parts.append(
                C.table(
                    ["system", "TTFT (s)", "cached tok", "TTFT / hyserve-on"],
                    [
                        [n, C.fmt_s(v["ttft"]), v["cached_tokens"], C.fmt_ratio(v["ttft_over_on"]) + "x"]
                        for n, v in last.items()
                    ],
                )
                + "\n"
            )
        if h["under_block_reuse"]:
            parts.append(f"**{model}: warm turns (2nd on) with prompts under {BLOCK} tokens**: prior history reused\n")
            parts.append(
                C.table(
                    ["system", "requests", "history tok", "cached tok", "reused"],
                    [
                        [n, v["requests"], v["history_tokens"], v["cached_tokens"], C.fmt_ratio(v["reuse"], 3)]
                        for n, v in sorted(h["under_block_reuse"].items())
                    ],
                )
                + "\n"
            )
    return "\n".join(parts)


def summary_tables(results: dict) -> str:
    parts = []
    for model, per_wl in results.items():
        for wl, per_sys in per_wl.items():
            if not per_sys:
                continue
            parts.append(
                f"**{model} / {wl}** ({next(iter(per_sys.values()))['summary']['requests']} requests, "
                f"last prompt {next(iter(per_sys.values()))['rows'][-1]['prompt_tokens']} tokens)\n"
            )
            headers = [
                "system",
                "sum TTFT (s)",
                "mean warm TTFT (s)",
                "last TTFT (s)",
                "prefill tok computed",
                "cached frac",
                "mean ITL (ms)",
                "peak cache MiB",
                "TTFT speedup vs off",
                "bg CPU",
            ]
            rows = []
            for name, d in per_sys.items():
                s = d["summary"]
                rows.append(
                    [
                        name,
                        C.fmt_s(s["ttft_sum"]),
                        C.fmt_s(s["ttft_warm_mean"]),
                        C.fmt_s(s["ttft_last"]),
                        s["prefill_tokens"],
                        C.fmt_ratio(s["cached_fraction"], 3),
                        C.fmt_s(s["itl_mean"] * 1e3 if s["itl_mean"] is not None else None, 1),
                        f"{s['cache_bytes_max'] / 2**20:.1f}",
                        (C.fmt_ratio(s["speedup_vs_off"]) + "x") if s["speedup_vs_off"] else "-",
                        C.fmt_pct(s["others_busy_mean"]),
                    ]
                )
            parts.append(C.table(headers, rows) + "\n")
    return "\n".join(parts)


def turn_tables(results: dict, model: str, workload: str) -> str:
    per_sys = results.get(model, {}).get(workload, {})
    if not per_sys:
        return ""
    names = list(per_sys)
    first = per_sys[names[0]]["rows"]
    headers = ["step", "prompt tok"] + [f"{n} TTFT (s) [cached]" for n in names]
    rows = []
    for i, r0 in enumerate(first):
        row = [r0["step"], r0["prompt_tokens"]]
        for n in names:
            rr = per_sys[n]["rows"]
            row.append(f"{rr[i]['ttft']:.3f} [{rr[i]['cached_tokens']}]" if i < len(rr) else "-")
        rows.append(row)
    return C.table(headers, rows)


def plot(results: dict, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    markers = {"chat": "o", "sysprompt": "s", "agent": "^", "short": "x", "longshort": "D"}
    for model, per_wl in results.items():
        wls = [w for w in per_wl if per_wl[w]]
        if not wls:
            continue
        fig, axes = plt.subplots(1, len(wls), figsize=(4.2 * len(wls), 3.6), squeeze=False)
        for ax, wl in zip(axes[0], wls):
            for name, d in per_wl[wl].items():
                ax.plot([r["step"] for r in d["rows"]], [r["ttft"] for r in d["rows"]], marker=".", label=name)
            ax.set_title(f"{model}: {wl}")
            ax.set_xlabel("request (turn / conversation)")
            ax.set_ylabel("TTFT (s)")
            ax.set_yscale("log")
            ax.grid(alpha=0.3)
        axes[0][0].legend(fontsize=7)
        fig.tight_layout()
        path = out / f"ttft_vs_turn_{model}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        files.append(path)

    models = [m for m in results if any(results[m].values())]
    for kind in ("cached_fraction", "warm_cost"):
        fig, axes = plt.subplots(1, len(models), figsize=(4.6 * len(models), 3.8), squeeze=False)
        for ax, model in zip(axes[0], models):
            colors = {}
            for wl, per_sys in results[model].items():
                for name, d in per_sys.items():
                    rows = d["rows"] if kind == "cached_fraction" else [r for r in d["rows"] if r["step"] > 1]
                    if not rows:
                        continue
                    y = (
                        [r["cached_tokens"] / r["prompt_tokens"] for r in rows]
                        if kind == "cached_fraction"
                        else [r["ttft"] for r in rows]
                    )
                    color = colors.get(name)
                    x = (
                        [r["prompt_tokens"] for r in rows]
                        if kind == "cached_fraction"
                        else [r["history_tokens"] for r in rows]
                    )
                    (line,) = ax.plot(
                        x,
                        y,
                        linestyle="none",
                        marker=markers.get(wl, "."),
                        color=color,
                        alpha=0.8,
                        label=name if color is None else None,
                    )
                    colors[name] = line.get_color()
            ax.set_title(model)
            ax.set_xlabel(
                "prompt tokens (history + new turn)"
                if kind == "cached_fraction"
                else "history tokens before the new user message"
            )
            if kind == "cached_fraction":
                ax.set_ylabel("cached tokens / prompt tokens")
                ax.set_ylim(-0.05, 1.05)
            else:
                ax.set_ylabel("warm-turn TTFT (s)")
                ax.set_yscale("log")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7, title="markers: o chat, s sysprompt, ^ agent, x short, D longshort", title_fontsize=6)
        fig.tight_layout()
        path = out / ("cached_fraction_vs_prompt.png" if kind == "cached_fraction" else "warm_cost_vs_history.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        files.append(path)
    return files


# -- main --------------------------------------------------------------------------------------------
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny models and small workloads (< 2 minutes, CI smoke)")
    p.add_argument(
        "--models",
        default=",".join(ALL_MODELS),
        help=f"comma list of hyserve.testing.tiny archs (default {', '.join(ALL_MODELS)}; 'hybrids': the families "
        f"of issue 21: {', '.join(HYBRID_MODELS)})",
    )
    p.add_argument(
        "--systems",
        default=",".join(ALL_SYSTEMS),
        help=f"comma list from {', '.join(ALL_SYSTEMS)}; the first one's replies form the history",
    )
    p.add_argument("--workloads", default=",".join(ALL_WORKLOADS), help=f"comma list from {', '.join(ALL_WORKLOADS)}")
    p.add_argument("--out", default=None, help="output folder (default benchmarks/results/run-<timestamp>)")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default 2)")
    p.add_argument("--cache-bytes", type=int, default=3 << 30, help="prefix-cache budget per hyserve system")
    p.add_argument(
        "--budget",
        type=float,
        default=1080.0,
        help="seconds; once exceeded, the remaining (model, system) pairs are skipped",
    )
    p.add_argument(
        "--wait-quiet",
        type=float,
        default=None,
        help="before each model x system segment, wait up to this many seconds for other processes to "
        "go quiet (default 30; quick 0)",
    )
    p.add_argument(
        "--retries",
        type=int,
        default=None,
        help="repeat a model x system block (keeping the quieter attempt) when other processes used more "
        "than --busy-threshold of the CPU during it (default 2; quick 0)",
    )
    p.add_argument("--busy-threshold", type=float, default=0.15)
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    args.systems = [s for s in args.systems.split(",") if s]
    args.workloads = [w for w in args.workloads.split(",") if w]
    dedupe = lambda xs: list(dict.fromkeys(xs))  # noqa: E731
    args.models, args.systems, args.workloads = dedupe(args.models), dedupe(args.systems), dedupe(args.workloads)
    if args.wait_quiet is None:
        args.wait_quiet = 0.0 if args.quick else 30.0
    if args.retries is None:
        args.retries = 0 if args.quick else 2
    args.models = [x for m in args.models for x in (HYBRID_MODELS if m == "hybrids" else (m,))]
    for m in args.models:
        if m not in ARCHS:
            p.error(f"unknown model {m!r}")
    for w in args.workloads:
        if w not in ALL_WORKLOADS:
            p.error(f"unknown workload {w!r}")
    for s in args.systems:
        if s not in ALL_SYSTEMS and not (s.startswith("block-") and s[6:].isdigit()):
            p.error(f"unknown system {s!r}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    threads = C.setup_torch(args.threads)
    C.warn_if_busy()
    from tqdm import tqdm

    size = "tiny" if args.quick else "bench"
    out = Path(args.out) if args.out else C.RESULTS_DIR / time.strftime("run-%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    info = C.machine_info()
    info["torch_threads"] = threads
    t_start = time.perf_counter()
    dirs = {m: C.ensure_model(m, size) for m in args.models}

    from transformers import AutoTokenizer

    plans = {}
    for m in args.models:
        tok = AutoTokenizer.from_pretrained(dirs[m], local_files_only=True)
        plans[m] = make_workloads(tok, "quick" if args.quick else "full", args.workloads, args.seed)
    total = sum(wl.requests for m in args.models for wl in plans[m]) * len(args.systems)
    print(
        f"{size} models {args.models}, systems {args.systems}, workloads {args.workloads}: {total} requests; "
        f"{info['cores']} cores, torch {info['torch']} ({threads} threads), transformers {info['transformers']}",
        file=sys.stderr,
        flush=True,
    )

    results: dict = {m: {w: {} for w in args.workloads} for m in args.models}
    skipped, segments = [], []
    with tqdm(total=total, unit="req", file=sys.stderr, mininterval=1.0, dynamic_ncols=True) as bar:
        for m in args.models:
            for sname in args.systems:
                n_req = sum(wl.requests for wl in plans[m])
                if time.perf_counter() - t_start > args.budget:
                    skipped.append([m, sname])
                    bar.update(n_req)
                    continue
                best = None
                for attempt in range(1 + args.retries):
                    bar.set_description(f"{m} {sname}" + (f" (retry {attempt})" if attempt else ""))
                    quiet = C.wait_for_quiet(args.wait_quiet) if args.wait_quiet > 0 else {}
                    t_sys = time.perf_counter()
                    mon = C.CpuMonitor()
                    system = make_system(sname, dirs[m], args.cache_bytes)
                    warm_up(system)
                    rows_by_wl, incomplete = {}, None
                    try:
                        for wl in plans[m]:
                            rows_by_wl[wl.name] = run_workload(system, wl, bar, t_start + args.budget)
                    except OutOfTime as exc:
                        incomplete = str(exc)
                        print(
                            f"\n{m} {sname}: time budget of {args.budget:.0f}s used up ({exc}); the rest of this "
                            f"block is skipped",
                            file=sys.stderr,
                            flush=True,
                        )
                    system.reset()
                    system.close()
                    del system
                    seg = {
                        "model": m,
                        "system": sname,
                        "attempt": attempt + 1,
                        "incomplete": incomplete,
                        "seconds": round(time.perf_counter() - t_sys, 1),
                        "waited_for_quiet": quiet.get("waited"),
                        "others_busy_before": quiet.get("others_busy"),
                        "others_busy_during": mon.stop(),
                    }
                    segments.append(seg)
                    busy = seg["others_busy_during"] or 0.0
                    # a complete attempt beats an incomplete one; among equals the quieter one wins
                    rank = (incomplete is not None, busy)
                    if best is None or rank < best[0]:
                        best = (rank, rows_by_wl, seg)
                    elapsed = time.perf_counter() - t_start
                    if (
                        busy <= args.busy_threshold
                        or attempt == args.retries
                        or incomplete
                        or elapsed + seg["seconds"] > args.budget
                    ):  # a retry must fit in the budget
                        break
                    print(
                        f"\n{m} {sname}: other processes used {busy:.0%} of the CPU during the run; repeating it",
                        file=sys.stderr,
                        flush=True,
                    )
                    bar.update(-n_req)
                    bar.refresh()
                best[2]["kept"] = True
                for wl_name, rows in best[1].items():
                    if rows:
                        results[m][wl_name][sname] = {"rows": rows}
                if best[2]["incomplete"]:
                    skipped.append([m, sname, best[2]["incomplete"]])
    for per_wl in results.values():
        for per_sys in per_wl.values():
            ref = per_sys.get("hyserve-off", {}).get("rows")
            for d in per_sys.values():
                d["summary"] = summarize(d["rows"], ref)

    info["loadavg_end"] = C._loadavg()
    wall = time.perf_counter() - t_start
    payload = {
        "args": {k: v for k, v in vars(args).items()},
        "size": size,
        "machine": info,
        "wall_seconds": wall,
        "segments": segments,
        "skipped": skipped,
        "workload_sizes": SIZES["quick" if args.quick else "full"],
        "results": results,
        "headline": headline(results),
    }
    (out / "results.json").write_text(json.dumps(payload, indent=2, default=str))
    md = [
        f"Command: `python benchmarks/bench_run.py {' '.join(sys.argv[1:] if argv is None else argv)}`  ",
        f"Machine: {info['cores']} cores ({info['cpu']}), torch {info['torch']} ({threads} threads), "
        f"transformers {info['transformers']}, load average {info['loadavg_start']} at start, "
        f"{info['loadavg_end']} at end; wall time {wall:.0f}s  ",
        "bg CPU = share of the machine's CPU used by other processes while the requests ran (0% = quiet).\n",
        headline_tables(payload["headline"]),
        summary_tables(results),
        "Segments (one row per attempt at a model x system block; kept = the attempt reported above; waited = "
        "seconds spent waiting for a quiet machine first):\n",
        C.table(
            ["model", "system", "attempt", "kept", "seconds", "waited (s)", "bg CPU before", "bg CPU during"],
            [
                [
                    g["model"],
                    g["system"],
                    g["attempt"],
                    "yes" if g.get("kept") else "no",
                    g["seconds"],
                    g["waited_for_quiet"] if g["waited_for_quiet"] is not None else "-",
                    C.fmt_pct(g["others_busy_before"]),
                    C.fmt_pct(g["others_busy_during"]),
                ]
                for g in segments
            ],
        )
        + "\n",
    ]
    for m in results:
        for wl in results[m]:
            t = turn_tables(results, m, wl)
            if t:
                md.append(f"\n{m} / {wl}, per request: TTFT seconds [cached tokens]\n\n{t}\n")
    (out / "summary.md").write_text("\n".join(md))
    print(summary_tables(results))
    print(headline_tables(payload["headline"]))
    if skipped:
        print(f"skipped for the time budget: {skipped}")
    if not args.no_plots:
        try:
            files = plot(results, out)
            print("plots: " + ", ".join(str(f) for f in files))
        except ImportError:
            print("matplotlib is not installed (pip install matplotlib): no plots written", file=sys.stderr)
    print(f"wrote {out / 'results.json'} and {out / 'summary.md'}; wall time {wall:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The tables of docs/benchmarks.md, generated from the result files in benchmarks/results/.

Each benchmark writes a JSON file there (the command is in the doc, above each table). The doc holds one
generated block per result file, between `<!-- bench_report: NAME -->` and `<!-- /bench_report -->`; this
script renders every block from its file: where, when and how it was measured (commit, UTC date, command,
CPU, cores, library versions, from the file's `machine`; for a file without them, the commit and date of
the file in `git log`), then the script's own tables. A block whose file is missing says so.

    python benchmarks/bench_report.py                # print every block
    python benchmarks/bench_report.py --write        # rewrite the blocks in docs/benchmarks.md, draw the plots
                                                     # of bench_plots.py into docs/img/ (NAME.png and the
                                                     # series it draws, NAME.json), copy the plots of
                                                     # benchmarks/results/run/ there
    python benchmarks/bench_report.py --check        # exit 1 when docs/benchmarks.md or a plot's series
                                                     # differs from the results
    python benchmarks/bench_report.py --results DIR --doc FILE   # other locations
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common as C  # noqa: E402
import bench_plots  # noqa: E402

ROOT = C.BENCH_DIR.parent
DOC = ROOT / "docs" / "benchmarks.md"
BLOCK = re.compile(r"(<!-- bench_report: (\S+) -->\n)(.*?)(<!-- /bench_report -->)", re.S)
RUN_PLOTS = ("warm_cost_vs_history.png", "cached_fraction_vs_prompt.png", "ttft_vs_turn_qwen3_5.png")


# -- one renderer per benchmark: the result's JSON -> its tables -------------------------------------------
def multiturn(r: dict) -> str:
    import bench_multiturn

    turns = r["turns"]
    last = turns[-1]
    out = [bench_multiturn.turn_table(turns), ""]
    if last["server_ttft_on"]:
        out.append(
            f"Last turn, the engine's own TTFT (no HTTP): off / on = {last['server_ttft_off']:.3f} / "
            f"{last['server_ttft_on']:.4f} s = {last['server_ttft_off'] / last['server_ttft_on']:.1f}x."
        )
    if r.get("warm"):
        w = r["warm"]
        out.append(
            f"Warm turns: sum TTFT off / on = {w['speedup']:.2f}x; server / bare loop = "
            f"{w['on_over_bare']:.2f} aggregate, {w['on_over_bare_worst']:.2f} worst turn."
        )
    same = sum(t["replies_equal"] for t in turns)
    out.append(
        f"Replies identical with the cache on and off on {same} of {len(turns)} turns; medians of "
        f"{len(r['runs_used'])} repeats."
    )
    return "\n".join(out)


def run(r: dict) -> str:
    import bench_run

    out = []
    rows = [
        [model, name, C.fmt_s(v["ttft"]), v["cached_tokens"], C.fmt_ratio(v["ttft_over_on"]) + "x"]
        for model, h in r["headline"].items()
        for name, v in h.get("longshort_last", {}).items()
    ]
    if rows:
        out += [
            "A short turn after a long history (`longshort`, last request), engine TTFT:",
            "",
            C.table(["model", "system", "TTFT (s)", "cached tok", "TTFT / hyserve-on"], rows),
            "",
        ]
    systems = [s for s in bench_run.ALL_SYSTEMS if any(s in h["under_block_reuse"] for h in r["headline"].values())]
    rows = []
    for model, h in r["headline"].items():
        reuse = h["under_block_reuse"]
        if reuse:
            first = next(iter(reuse.values()))
            rows.append(
                [f"{model} ({first['requests']} requests, {first['history_tokens']} history tok)"]
                + [C.fmt_ratio(reuse[s]["reuse"], 3) if s in reuse else "-" for s in systems]
            )
    if rows:
        out += [
            f"Warm turns with prompts under {bench_run.BLOCK} tokens: share of the prior history reused:",
            "",
            C.table(["model"] + systems, rows),
            "",
        ]
    speed = [s for s in systems if s != "hyserve-off"]
    rows = []
    for model, per_wl in r["results"].items():
        for wl, per_sys in per_wl.items():
            if "hyserve-off" not in per_sys:
                continue
            any_sys = next(iter(per_sys.values()))
            on = per_sys.get("hyserve-on", {}).get("summary")
            rows.append(
                [model, wl, any_sys["summary"]["requests"], any_sys["rows"][-1]["prompt_tokens"]]
                + [C.fmt_ratio(per_sys[s]["summary"]["speedup_vs_off"]) + "x" if s in per_sys else "-" for s in speed]
                + [C.fmt_ratio(on["cached_fraction"], 3) if on else "-"]
            )
    if rows:
        out += [
            "Every workload: sum of hyserve-off's TTFT / sum of the system's TTFT over all its requests:",
            "",
            C.table(["model", "workload", "requests", "last prompt tok"] + speed + ["hyserve-on cached/prompt"], rows),
            "",
        ]
    if r.get("skipped"):
        out.append(f"Skipped for the time budget: {r['skipped']}.")
    return "\n".join(out).rstrip()


def peers(r: dict) -> str:
    import bench_peers

    same = sum(t["replies_equal"] for t in r["turns"])
    return "\n".join(
        [
            bench_peers.turn_table(r["turns"]),
            "",
            f"llama-server: {r['llama_server']['version']}; medians of {len(r['runs'])} repeats; greedy "
            f"replies identical between the servers on {same} of {len(r['turns'])} turns.",
        ]
    )


def peers_real(r: dict) -> str:
    import bench_peers

    out = []
    if r.get("throughput"):
        t = r["throughput"]
        out += [bench_peers.throughput_table(t), ""]
        pairs = list(zip(t["hyserve"].get("rounds", []), t["llama"].get("rounds", [])))
        if len(pairs) > 1:
            per = "; ".join(
                f"{label} " + ", ".join(f"{h[k] / ll[k]:.2f}" for h, ll in pairs)
                for label, k in (
                    ("cold prefill", "cold_tok_s"),
                    ("decode 1", "decode_tok_s"),
                    ("decode concurrent", "concurrent_tok_s"),
                )
            )
            out += [f"hyserve / llama in each of the {len(pairs)} rounds: {per}.", ""]
    if r.get("turns"):
        out += [peers(r)]
        warm = [t for t in r["turns"][1:] if t.get("llama_over_hyserve")]
        if warm:
            worst = min(t["llama_over_hyserve"] for t in warm)
            out += [
                "",
                f"Warm turns: hyserve's TTFT is at most {1 / worst:.2f}x llama-server's on every turn "
                f"(llama/hyserve {worst:.1f}x or more).",
            ]
    return "\n".join(out).rstrip()


def peers_quant(r: dict) -> str:
    """`bench_peers.py --quantization`: hyserve / llama-server at the same bits against issue 37's targets."""
    import bench_llama_quant as Q

    q, t = r["quantization"], r.get("throughput") or {}
    rounds = len(t.get("hyserve", {}).get("rounds", []))
    repeats = len(next(iter((r.get("peers_chat") or {}).values()), {}).get("runs", []))
    flags = ", ".join(r["machine"].get("cpu_flags") or []) or "unknown"
    return "\n".join(
        [
            Q.quant_table(r),
            "",
            (
                f"Throughput: medians of {rounds} rounds alternating between the servers; "
                if rounds
                else "Throughput: not measured in this run (no `--throughput`); "
            )
            + (
                f"warm turn: median over turns 2 on of {repeats} chat repeat(s) against each type, "
                f"TTFT + {Q.WARM_TOKENS} x the reply's seconds per token. "
                if repeats
                else "warm turn: not measured in this run (`--no-chat`). "
            )
            + (
                f"Prompt caches: {mib} MiB each (hyserve `--cache-bytes`, llama-server `--cache-ram`). "
                if (mib := r["args"].get("prompt_cache_mib"))
                else "Prompt caches: hyserve's 2 GiB, llama-server's at its default `--cache-ram` (8 GiB). "
            )
            + f"hyserve `--quantization {q['scheme']}`; llama-server {r['llama_server']['version']}; llama-quantize "
            f"{q['llama_quantize'].get('version') or 'of an unknown build'}, from the {q['source_type']} GGUF of "
            f"llama.cpp's converter. CPU flags: {flags}.",
            "",
            Q.files_table(r),
        ]
    )


def peers_same_file(r: dict) -> str:
    """`bench_peers.py --same-file`: one GGUF file served by both, and each side's fraction of the read-bandwidth
    limit of one-request decode."""
    lim = (r.get("throughput") or {}).get("limit")
    line = (
        f"Read bandwidth {lim['bandwidth_gbs']:.1f} GB/s (2 threads, best of 10 sums over 1 GiB, in this run); "
        f"{lim['bytes_per_token'] / 2**20:.1f} MiB of weights streamed per token (every tensor but the embedding): "
        f"limit {lim['limit_tok_s']:.1f} tokens/s. One request decodes at **{lim['hyserve_fraction']:.2f}** of it "
        f"(hyserve) and {lim['llama_fraction']:.2f} (llama-server)."
        if lim
        else "No bandwidth measured in this run."
    )
    text = peers_quant(r).replace(f"hyserve `--quantization {r['quantization']['scheme']}`", "hyserve serving the file")
    return text + "\n\n" + line


def speculative(r: dict) -> str:
    import bench_speculative as S

    s = r["settings"]
    out = [
        f"Oracle proposer ({s['max_tokens']} completion tokens, median of {s['rounds']} interleaved rounds):",
        "",
        S.oracle_table(r),
        "",
        f"Real `PromptLookup` (k={s['lookup_k']}, n={s['ngram']}):",
        "",
        S.lookup_table(r),
        "",
    ]
    out.append(
        "Spec-on output token-identical to spec off in every run."
        if not r["mismatches"]
        else f"Spec-on output differed from spec off: {r['mismatches']}."
    )
    return "\n".join(out)


def speculative_trained(r: dict) -> str:
    import bench_speculative as S

    return "\n".join(
        [
            f"Prompt lookup (k={r['k']}, n={r['ngram']}) against none on `{r['model']}`, replies of up to "
            f"{r['max_tokens']} tokens ending at EOS, median of {r['rounds']} interleaved round(s):",
            "",
            S.trained_table(r),
            "",
            "Lookup output token-identical to no speculation in every run."
            if not r["mismatches"]
            else f"Lookup output differed from no speculation: {r['mismatches']}.",
        ]
    )


def load(r: dict) -> str:
    import bench_load

    out = [bench_load.load_table(r["phases"]), ""]
    if r.get("ratio"):
        x = r["ratio"]
        out.append(
            f"Decode tok/s N={x['to']} / N={x['from']} = {x['decode']:.2f}x; output tok/s {x['output']:.2f}x"
            + (f"; decode-pass tok/s {x['pass']:.2f}x" if x.get("pass") else "")
            + "."
        )
    c = r["reply_consistency"]
    out.append(
        f"Replies identical to the first phase that ran the same session on {c['equal_turns']} of "
        f"{c['compared_turns']} turns compared; {r['failures']} failures."
    )
    if r.get("decode_probe"):
        out += [
            "",
            "Decode-step probe (one token for N live states, no HTTP, no prefill):",
            "",
            bench_load.probe_table(r["decode_probe"]),
        ]
    if r.get("soak"):
        out += ["", "Soak:", "", bench_load.soak_table(r["soak"])]
    return "\n".join(out)


def memory(r: dict) -> str:
    import bench_memory

    return "\n".join(
        [
            bench_memory.census_table(r["rows"]),
            "",
            f"{len(r['failures'])} failures; the last row is after the load ended.",
        ]
    )


def kernels(r: dict) -> str:
    import bench_kernels

    return "\n".join(
        [
            f"Medians over {r['rounds']} rounds; (Nx) = speed against `reference`:",
            "",
            bench_kernels.summary_table(r["summary"]),
            "",
            "Greedy tokens from the warm state "
            + ("identical" if r["greedy_identical"] else "DIFFERENT")
            + " in all variants. The kernels alone at the warm turn's shapes (median ms):",
            "",
            bench_kernels.micro_table(r["micro"]),
        ]
    )


def threads(r: dict) -> str:
    import bench_threads

    return "\n".join(
        [
            f"{r['context']}-token state, {r['new_tokens']} new tokens, median of {r['repeats']}:",
            "",
            bench_threads.where_table(r["rows"], r["new_tokens"]),
        ]
    )


def long_decode(r: dict) -> str:
    import bench_long_decode

    return f"Median of {r['steps']} alternating decode steps:\n\n" + bench_long_decode.context_table(r["rows"])


def idle(r: dict) -> str:
    import bench_idle

    return bench_idle.idle_table(r["rows"])


def disk(r: dict) -> str:
    import bench_disk

    return bench_disk.tables(r)


def kv_sharing(r: dict) -> str:
    import bench_kv_sharing

    return bench_kv_sharing.tables(r)


def replicas(r: dict) -> str:
    import bench_replicas

    return bench_replicas.tables(r)


# block name -> (file under the results folder, renderer)
def agent(result: dict) -> str:
    import bench_agent

    return bench_agent.table(result)


def agent_framework(result: dict) -> str:
    import bench_agent_framework

    return bench_agent_framework.table(result)


def real(result: dict) -> str:
    import bench_real

    return bench_real.table(result)


def snapshot_copy(result: dict) -> str:
    import bench_snapshot_copy

    return bench_snapshot_copy.table(result)


def decode_step(result: dict) -> str:
    import bench_decode_step

    return bench_decode_step.table(result)


def quant_a8_kernels(result: dict) -> str:
    import bench_quant

    return bench_quant.a8_table(result)


def quality(result: dict) -> str:
    import bench_quality

    return bench_quality.table(result)


def gpu(result: dict) -> str:
    import bench_real

    gpu_name = (result.get("machine") or {}).get("gpu", "GPU unknown")
    return "\n\n".join(f"`{model}` on {gpu_name}:\n\n{bench_real.table(r)}" for model, r in result["models"].items())


REPORTS = {
    "real": ("real.json", real),
    "real-ab": ("real-ab.json", real),
    "real-ab2": ("real-ab2.json", real),
    "decode-step": ("decode-step.json", decode_step),
    "decode-step-a8": ("decode-step-a8.json", decode_step),
    "snapshot-copy": ("snapshot-copy.json", snapshot_copy),
    "real-moe": ("real-moe.json", real),
    "gpu": ("gpu.json", gpu),
    "agent": ("agent.json", agent),
    "agent-back-to-back": ("agent-back-to-back.json", agent),
    "agent-framework": ("agent-framework.json", agent_framework),
    "multiturn-4k-64new": ("multiturn-4k-64new.json", multiturn),
    "multiturn-8turn": ("multiturn-8turn.json", multiturn),
    "multiturn-split": ("multiturn-4k-short-split.json", multiturn),
    "run": ("run/results.json", run),
    "run-hybrids": ("run-hybrids/results.json", run),
    "peers": ("peers.json", peers),
    "peers-growing": ("peers-growing.json", peers),
    "peers-real": ("peers-real.json", peers_real),
    "peers-real-chat": ("peers-real-chat.json", peers_real),
    "peers-real-malloc-keep-0": ("peers-real-malloc-keep-0.json", peers_real),
    "peers-real-0.8b-int8": ("peers-real-0.8b-int8.json", peers_quant),
    "peers-real-0.8b-int4": ("peers-real-0.8b-int4.json", peers_quant),
    "peers-real-4b-int8": ("peers-real-4b-int8.json", peers_quant),
    "peers-real-4b-int4": ("peers-real-4b-int4.json", peers_quant),
    "peers-real-0.8b-w8a8": ("peers-real-0.8b-w8a8.json", peers_quant),
    "peers-real-0.8b-w4a8": ("peers-real-0.8b-w4a8.json", peers_quant),
    "peers-real-4b-w8a8": ("peers-real-4b-w8a8.json", peers_quant),
    "peers-real-4b-w4a8": ("peers-real-4b-w4a8.json", peers_quant),
    "peers-real-4b-w4a8-chat": ("peers-real-4b-w4a8-chat.json", peers_quant),
    "same-file-real-0.8b-Q4_K_M": ("peers-same-file-real-0.8b-Q4_K_M.json", peers_same_file),
    "same-file-real-0.8b-Q4_0": ("peers-same-file-real-0.8b-Q4_0.json", peers_same_file),
    "same-file-real-0.8b-Q8_0": ("peers-same-file-real-0.8b-Q8_0.json", peers_same_file),
    "speculative": ("speculative.json", speculative),
    "speculative-smollm2": ("speculative-smollm2.json", speculative_trained),
    "load": ("load.json", load),
    "memory": ("memory.json", memory),
    "kernels": ("kernels.json", kernels),
    "threads": ("threads.json", threads),
    "long_decode": ("long_decode.json", long_decode),
    "idle": ("idle.json", idle),
    "disk": ("disk.json", disk),
    "kv-sharing": ("kv-sharing.json", kv_sharing),
    "replicas": ("replicas.json", replicas),
    "quality": ("quality.json", quality),
    "quant-a8-kernels": ("quant-a8-kernels.json", quant_a8_kernels),
}


# -- the summary: one row per headline result, from several files ------------------------------------------
SUMMARY_FILES = (
    "multiturn-4k-64new.json",
    "agent.json",
    "run-hybrids/results.json",
    "peers-real-chat.json",
    "peers-real.json",
    "kv-sharing.json",
    "replicas.json",
    "quality.json",
    "peers-real-4b-w4a8.json",  # its row holds every 4B scheme measured
)


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return (xs[(len(xs) - 1) // 2] + xs[len(xs) // 2]) / 2


def _span(xs: list[float], digits: int = 2) -> str:
    lo, hi = min(xs), max(xs)
    return f"{lo:.{digits}f}x" if f"{lo:.{digits}f}" == f"{hi:.{digits}f}" else f"{lo:.{digits}f}-{hi:.{digits}f}x"


def summary_rows(results: Path) -> list[list[str]]:
    """[question, result, section link] for each headline whose result file exists."""

    def load(name):
        path = results / name
        return json.loads(path.read_text()) if path.is_file() else None

    rows = []
    if r := load("multiturn-4k-64new.json"):
        last = r["turns"][-1]
        rows.append(
            [
                f"{last['prompt_tokens'] - last['cached_tokens']} new prompt tokens after "
                f"{last['cached_tokens']} tokens of history",
                f"TTFT {C.fmt_ratio(last['speedup'])}x lower than `--no-cache`; same replies",
                "warm-turn-speedup-in-a-multi-turn-chat-bench_multiturnpy",
            ]
        )
    if (r := load("agent.json")) and (warm := [row for row in r["rows"] if row["history_tokens"]]):
        rows.append(
            [
                f"an agent on the real Qwen3.5 template, {len(warm)} warm turns",
                f"{_median([w['cached_over_history'] for w in warm]):.1%} of the history from the cache, "
                f"TTFT {C.fmt_ratio(_median([w['ttft_off_s'] / w['ttft_on_s'] for w in warm]))}x lower "
                "(median)",
                "an-agent-on-the-real-qwen35-template-bench_agentpy",
            ]
        )
    if (r := load("run-hybrids/results.json")) and (
        last := [h["longshort_last"] for h in r["headline"].values() if h.get("longshort_last")]
    ):
        blocks = [k for k in last[0] if k.startswith("block-")]
        if blocks and all(blocks[0] in h and "hyserve-off" in h for h in last):
            rows.append(
                [
                    f"a short turn after ~4k tokens, {len(last)} hybrid families, against a "
                    f"{blocks[0].split('-')[1]}-token block-grid cache",
                    f"block grid's TTFT {_span([h[blocks[0]]['ttft_over_on'] for h in last], 1)} hyserve's; "
                    f"no cache {_span([h['hyserve-off']['ttft_over_on'] for h in last], 0)}",
                    "reuse-against-a-block-grid-cache-and-plain-generate-bench_runpy",
                ]
            )
    if (r := load("peers-real-chat.json")) and (warm := [t for t in r["turns"] if t["hyserve"]["cached_tokens"]]):
        rows.append(
            [
                f"a chat growing to {r['turns'][-1]['hyserve']['prompt_tokens']} tokens on the real Qwen3.5 "
                "template, real-0.8b bfloat16, against llama-server",
                f"hyserve's TTFT {_span([t['hyserve']['ttft'] / t['llama']['ttft'] for t in warm])} "
                f"llama-server's on the {len(warm)} warm turns",
                "against-llamacpps-llama-server-bench_peerspy",
            ]
        )
    if (r := load("peers-real.json")) and r.get("throughput"):
        h, ll = r["throughput"]["hyserve"], r["throughput"]["llama"]
        n = len(h["concurrent_completion_tokens"])
        rows.append(
            [
                "cold prefill and decode, real-0.8b bfloat16, against llama-server",
                f"prefill {C.fmt_ratio(h['cold_tok_s'] / ll['cold_tok_s'])}x, decode "
                f"{C.fmt_ratio(h['decode_tok_s'] / ll['decode_tok_s'])}x (1 request), "
                f"{C.fmt_ratio(h['concurrent_tok_s'] / ll['concurrent_tok_s'])}x ({n} at once) its speed",
                "against-llamacpps-llama-server-bench_peerspy",
            ]
        )
    if r := load("kv-sharing.json"):
        shared, whole = r["modes"]["shared"], r["modes"]["whole"]
        rows.append(
            [
                f"{shared['entries']} checkpoints of one conversation, attention KV stored once",
                f"{shared['bytes'] / whole['bytes']:.0%} of the bytes of whole copies",
                "attention-kv-stored-once-along-the-tree-bench_kv_sharingpy",
            ]
        )
    if r := load("replicas.json"):
        live = r["live"]
        routers = live["routers"]
        rows.append(
            [
                f"{live['sessions']} chats on {live['replicas']} Ray Serve replicas",
                "history from the cache: "
                + ", ".join(f"{name} {v['cached_over_history']:.0%}" for name, v in routers.items()),
                "several-replicas-on-ray-serve-bench_replicaspy",
            ]
        )
    decode = [
        f"{scheme} {C.fmt_ratio(t['hyserve']['decode_tok_s'] / t['llama']['decode_tok_s'])}x "
        f"its {next(iter(t['peers']))}"
        for scheme in ("int8", "w8a8", "int4", "w4a8")
        if (r := load(f"peers-real-4b-{scheme}.json")) and (t := r.get("throughput"))
    ]
    if decode:
        rows.append(
            [
                "one request's decode at 4.2B (Qwen3.5-4B's dimensions), quantized, against llama-server",
                ", ".join(decode),
                "quantized-at-the-same-bits-bench_peerspy---quantization",
            ]
        )
    if r := load("quality.json"):
        q = r["schemes"]
        rows.append(
            [
                f"quantized weights, {r['model'].split('.')[0]}: top-1 token as float32's",
                ", ".join(f"{name} {v['top1_agreement']:.1%}" for name, v in q.items() if name != "float32"),
                "what-quantized-weights-cost-in-quality-bench_qualitypy",
            ]
        )
    return rows


def _isa(machine: dict) -> str | None:
    """The CPU's widest vector instructions: recorded since bench_common.vector_isa, else from `cpu_flags`."""
    return machine.get("isa") or C.isa_of(set(machine.get("cpu_flags") or ()))


def _machines(results: Path) -> str:
    """The machines the summary's files were measured on, as `2 cores (AMD EPYC)`."""
    seen = []
    for name in SUMMARY_FILES:
        path = results / name
        m = (json.loads(path.read_text()).get("machine") or {}) if path.is_file() else {}
        if m.get("cores") and (label := f"{m['cores']} cores ({m.get('cpu') or 'CPU unknown'})") not in seen:
            seen.append(label)
    return " and ".join(seen) or "an unrecorded machine"


def summary(results: Path) -> str:
    rows = [[question, result, f"[more](#{anchor})"] for question, result, anchor in summary_rows(results)]
    if not rows:
        return "_No result yet._"
    table = ["| what | result | |", "|---|---|---|"] + ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(
        table
        + [
            "",
            f"Each row links to its section: the command, the model, the machine and the full "
            f"table. Measured on {_machines(results)}; compare rows within a table, not across "
            "tables.",
        ]
    )


# -- provenance and blocks ---------------------------------------------------------------------------------
def _git_log(path: Path) -> tuple[str | None, str | None]:
    """Commit and UTC date of the last commit that touched `path` (None, None if it was never committed)."""
    try:
        out = subprocess.run(
            ["git", "log", "-1", "--format=%H %cd", "--date=format-local:%Y-%m-%dT%H:%M:%SZ", "--", str(path)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=30,
            env={**os.environ, "TZ": "UTC"},
        ).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return None, None
    return (out[0], out[1]) if len(out) == 2 else (None, None)


def provenance(result: dict, path: Path) -> str:
    """One line: command, commit, date, machine, versions."""
    m = result.get("machine") or {}
    commit, date = m.get("commit"), m.get("date")
    if not commit or not date:  # a result from before the scripts recorded them: the file's own commit
        commit, date = _git_log(path)
    command = m.get("command") or result.get("command")
    parts = [
        f"`{command}`" if command else "an unrecorded command",
        f"at `{commit[:7]}`" + (" with uncommitted changes" if m.get("dirty") else "")
        if commit
        else "at an unknown commit",
        f"on {date[:10]}" if date else "on an unknown date",
    ]
    machine = [
        (m.get("cpu") or "CPU unknown") + (f" ({_isa(m)})" if _isa(m) else ""),
        f"{m['cores']} cores" if m.get("cores") else None,
        f"{m['mem_gib']} GiB RAM" if m.get("mem_gib") else None,
        f"torch {m['torch']}" if m.get("torch") else None,
        f"transformers {m['transformers']}" if m.get("transformers") else None,
        f"{m['torch_threads']} torch threads" if m.get("torch_threads") else None,
    ]
    return "Measured with " + " ".join(parts) + "; " + ", ".join(x for x in machine if x) + "."


def render(name: str, results: Path) -> str:
    if name == "summary":
        return summary(results)
    rel, fn = REPORTS[name]
    path = results / rel
    if not path.is_file():
        return (
            f"_No result yet: the command above writes `benchmarks/results/{rel}`; then "
            f"`python benchmarks/bench_report.py --write` fills this in._"
        )
    result = json.loads(path.read_text())
    text = provenance(result, path) + "\n\n" + fn(result)
    if name == "run":
        text += "".join(f"\n\n![{p[:-4].replace('_', ' ')}](img/{p})" for p in RUN_PLOTS if (path.parent / p).is_file())
    return text


def fill(doc: str, results: Path) -> str:
    """`doc` with every generated block rendered afresh from `results`."""
    unknown = [m.group(2) for m in BLOCK.finditer(doc) if m.group(2) not in REPORTS and m.group(2) != "summary"]
    if unknown:
        raise SystemExit(f"unknown report blocks in the doc: {unknown} (known: {list(REPORTS)})")
    return BLOCK.sub(lambda m: m.group(1) + render(m.group(2), results) + "\n" + m.group(4), doc)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", type=Path, default=C.RESULTS_DIR, help="folder of result files")
    p.add_argument("--doc", type=Path, default=DOC, help="the Markdown file with the generated blocks")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="rewrite the doc's blocks and copy the run's plots")
    mode.add_argument("--check", action="store_true", help="exit 1 when the doc's blocks are not up to date")
    args = p.parse_args(argv)
    if not (args.write or args.check):
        for name in REPORTS:
            print(f"<!-- bench_report: {name} -->\n{render(name, args.results)}\n")
        return 0
    doc = args.doc.read_text()
    new = fill(doc, args.results)
    if args.check:
        stale = [a.group(2) for a, b in zip(BLOCK.finditer(doc), BLOCK.finditer(new)) if a.group(3) != b.group(3)]
        stale += [f"img/{p}.json" for p in bench_plots.stale(args.results, args.doc.parent / "img")]
        if stale:
            print(
                f"{args.doc}: blocks and plots not generated from {args.results}: {stale}; run python "
                f"benchmarks/bench_report.py --write",
                file=sys.stderr,
            )
            return 1
        return 0
    args.doc.write_text(new)
    img = args.doc.parent / "img"
    bench_plots.write(args.results, img)
    for plot in RUN_PLOTS:
        if (args.results / "run" / plot).is_file():
            img.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(args.results / "run" / plot, img / plot)
    print(f"wrote {args.doc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The plots of docs/benchmarks.md, drawn from the committed results in benchmarks/results/.

Each plot is a function of the result files: `series(results)` extracts what it draws (plain numbers, written
beside the PNG as docs/img/NAME.json), `draw(data, path)` draws that. bench_report.py --write writes both;
--check compares the series with the committed JSON, so a plot cannot drift from its results (the pixels,
which depend on matplotlib's version and fonts, are not compared)."""

from __future__ import annotations

import json
from pathlib import Path


def _load(results: Path, name: str) -> dict | None:
    path = results / name
    return json.loads(path.read_text()) if path.is_file() else None


def _r(x: float, digits: int = 4) -> float:
    return round(float(x), digits)


# -- series: results -> the numbers a plot draws -----------------------------------------------------------
def ttft_vs_history(results: Path) -> dict | None:
    """TTFT against the prompt's length as a chat grows: hyserve against llama-server (real size, real template),
    and hyserve with the cache on against off (an agent on the real template)."""
    peers, agent = _load(results, "peers-real-chat.json"), _load(results, "agent.json")
    if peers is None or agent is None:
        return None
    turns = peers["turns"]
    return {
        "panels": [
            {
                "title": "real-0.8b bfloat16, Qwen3.5 template\n(bench_peers.py --size real-0.8b --growing)",
                "x": [t["hyserve"]["prompt_tokens"] for t in turns],
                "lines": {
                    "hyserve": [_r(t["hyserve"]["ttft"]) for t in turns],
                    "llama-server": [_r(t["llama"]["ttft"]) for t in turns],
                },
            },
            {
                "title": "bench qwen3_5 float32, an agent on the Qwen3.5 template\n(bench_agent.py)",
                "x": [row["prompt_tokens"] for row in agent["rows"]],
                "lines": {
                    "hyserve": [_r(row["ttft_on_s"]) for row in agent["rows"]],
                    "hyserve --no-cache": [_r(row["ttft_off_s"]) for row in agent["rows"]],
                },
            },
        ],
        "xlabel": "prompt tokens (the history + the new message)",
        "ylabel": "time to first token (s)",
    }


def decode_vs_concurrency(results: Path) -> dict | None:
    """Decode tokens/s of all requests together, 1 request against 8 at once, hyserve and llama-server."""
    peers = _load(results, "peers-real.json")
    if peers is None or not peers.get("throughput"):
        return None
    tp = peers["throughput"]
    return {
        "title": "real-0.8b bfloat16, 2 cores\n(bench_peers.py --size real-0.8b --throughput)",
        "x": [1, len(tp["hyserve"]["concurrent_completion_tokens"])],
        "bars": {
            name: [_r(tp[key]["decode_tok_s"], 2), _r(tp[key]["concurrent_tok_s"], 2)]
            for name, key in (("hyserve", "hyserve"), ("llama-server", "llama"))
        },
        "xlabel": "requests decoding at once",
        "ylabel": "decode tokens/s (all requests)",
    }


# (result file, label's size) of the quantized runs against llama-server; a file ending in -chat adds the warm turn
QUANT_RUNS = [
    ("peers-real-0.8b-w8a8.json", "0.75B"),
    ("peers-real-0.8b-w4a8.json", "0.75B"),
    ("peers-real-4b-w8a8.json", "4.2B"),
    ("peers-real-4b-w4a8.json", "4.2B"),
    ("peers-real-4b-w4a8-chat.json", "4.2B"),
]


def quantized_vs_llama(results: Path) -> dict | None:
    """hyserve / llama-server at the same bits for each quantized run and llama.cpp type, one panel per target of
    `bench_llama_quant.TARGETS` (the memory less the prompt caches left out), with the target's line."""
    import bench_llama_quant as Q

    ratios: dict[str, dict[str, float]] = {}
    for name, size in QUANT_RUNS:
        r = _load(results, name)
        if r is None or "quantization" not in r:
            continue
        for qtype, sides in Q.peer_values(r).items():
            got = ratios.setdefault(f"{size} {r['quantization']['scheme']} / {qtype}", {})
            for _, key, _, _ in Q.TARGETS:
                h, ll = sides["hyserve"][key], sides["llama"][key]
                if h is not None and ll:
                    got.setdefault(key, _r(h / ll, 3))
    if not ratios:
        return None
    return {
        "title": "hyserve / llama-server at the same bits, 2 cores (bench_peers.py --quantization)",
        "settings": list(ratios),
        "panels": [
            {
                "metric": label.split(" (")[0],
                "better": "higher" if higher else "lower",
                "target": target,
                "ratios": [ratios[s].get(key) for s in ratios],
            }
            for label, key, higher, target in Q.TARGETS
            if key != "rss_less_cache_mib"
        ],
    }


PLOTS = {
    "ttft_vs_history": ttft_vs_history,
    "decode_vs_concurrency": decode_vs_concurrency,
    "quantized_vs_llama": quantized_vs_llama,
}
COLORS = {"hyserve": "#1f77b4", "llama-server": "#d62728", "hyserve --no-cache": "#7f7f7f"}


# -- drawing ------------------------------------------------------------------------------------------------
def _draw_ttft(data: dict, ax_row) -> None:
    for ax, panel in zip(ax_row, data["panels"]):
        for name, ys in panel["lines"].items():
            ax.plot(panel["x"], ys, marker="o", label=name, color=COLORS.get(name))
        ax.set_title(panel["title"], fontsize=9)
        ax.set_xlabel(data["xlabel"])
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend()
    ax_row[0].set_ylabel(data["ylabel"])


def _draw_decode(data: dict, ax) -> None:
    width = 0.38
    for i, (name, ys) in enumerate(data["bars"].items()):
        xs = [j + (i - 0.5) * width for j in range(len(data["x"]))]
        bars = ax.bar(xs, ys, width, label=name, color=COLORS.get(name))
        ax.bar_label(bars, fmt="%.1f", fontsize=8)
    ax.set_xticks(range(len(data["x"])), [str(x) for x in data["x"]])
    ax.set_title(data["title"], fontsize=9)
    ax.set_xlabel(data["xlabel"])
    ax.set_ylabel(data["ylabel"])
    ax.grid(axis="y", alpha=0.3)
    ax.legend()


def _draw_quantized(data: dict, axes) -> None:
    ys = range(len(data["settings"]))
    for ax, panel in zip(axes, data["panels"]):
        shown = [(y, r) for y, r in zip(ys, panel["ratios"]) if r is not None]
        met = [(r >= panel["target"]) if panel["better"] == "higher" else (r <= panel["target"]) for _, r in shown]
        bars = ax.barh(
            [y for y, _ in shown],
            [r for _, r in shown],
            color=[COLORS["hyserve"] if m else "#ff7f0e" for m in met],
        )
        ax.bar_label(bars, fmt="%.2fx", fontsize=7, padding=2)
        for y, r in zip(ys, panel["ratios"]):
            if r is None:
                ax.text(0.05, y, "not measured", fontsize=7, va="center", color="#7f7f7f")
        ax.axvline(panel["target"], color="k", linestyle="--", linewidth=1)
        ax.axvline(1.0, color="#7f7f7f", linewidth=0.8)
        sign = ">=" if panel["better"] == "higher" else "<="
        ax.set_title(f"{panel['metric']}\n({panel['better']} is better, target {sign} {panel['target']}x)", fontsize=8)
        ax.set_yticks(list(ys), data["settings"] if ax is axes[0] else [""] * len(data["settings"]), fontsize=8)
        ax.set_xlim(0, max([r for _, r in shown] + [panel["target"], 1.0]) * 1.3)
        ax.invert_yaxis()
        ax.grid(axis="x", alpha=0.3)
    axes[0].figure.suptitle(data["title"] + "; orange: target missed", fontsize=9)


def draw(name: str, data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if name == "ttft_vs_history":
        fig, axes = plt.subplots(1, len(data["panels"]), figsize=(11, 4))
        _draw_ttft(data, axes)
    elif name == "quantized_vs_llama":
        fig, axes = plt.subplots(1, len(data["panels"]), figsize=(14, 3.6))
        _draw_quantized(data, axes)
    else:
        fig, ax = plt.subplots(figsize=(5.5, 4))
        _draw_decode(data, ax)
    fig.tight_layout()
    fig.savefig(path, dpi=100, metadata={"Software": None})
    plt.close(fig)


def write(results: Path, img: Path) -> list[str]:
    """Draw every plot whose results exist into `img` (NAME.png and its series NAME.json); the names drawn."""
    drawn = []
    for name, series in PLOTS.items():
        data = series(results)
        if data is None:
            continue
        img.mkdir(parents=True, exist_ok=True)
        (img / f"{name}.json").write_text(json.dumps(data, indent=1) + "\n")
        draw(name, data, img / f"{name}.png")
        drawn.append(name)
    return drawn


def stale(results: Path, img: Path) -> list[str]:
    """The plots whose committed series (img/NAME.json, or its PNG) differ from what the results give."""
    out = []
    for name, series in PLOTS.items():
        data = series(results)
        path = img / f"{name}.json"
        committed = json.loads(path.read_text()) if path.is_file() else None
        if data != committed or (data is not None and not (img / f"{name}.png").is_file()):
            out.append(name)
    return out

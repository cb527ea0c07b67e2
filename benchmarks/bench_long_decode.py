"""Decode of a single request at long context: KV grown in place vs concatenated every token.

`transformers`' `DynamicLayer` appends each new token's keys and values with `torch.cat`, which copies
the request's whole attention KV on every decode step. hyserve's decode path (`forward_batch`, also
for a batch of one) keeps the KV in a buffer with spare columns and writes each token in place. This
script times one decode step both ways on two copies of the same restored state, alternating A and B
step by step so both see the same machine, and checks the logits are identical.

    python benchmarks/bench_long_decode.py                      # bench qwen3_5, contexts 1k, 4k, 12k
    python benchmarks/bench_long_decode.py --contexts 2000,16000
    python benchmarks/bench_long_decode.py --quick              # tiny qwen3_5, a smoke test
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common as C  # noqa: E402


def context_table(rows: list[dict]) -> str:
    """One row per context length (the JSON's `rows`)."""
    return C.table(
        ["context tok", "concatenate (ms/step)", "in place (ms/step)", "concat / in place", "max |logit diff|"],
        [
            [
                r["context"],
                f"{r['concat_ms']:.2f}",
                f"{r['in_place_ms']:.2f}",
                f"{r['concat_ms'] / r['in_place_ms']:.2f}x",
                f"{r['max_logit_diff']:.1e}",
            ]
            for r in rows
        ],
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny model, short contexts, few steps")
    p.add_argument("--contexts", default=None, help="comma-separated context lengths (default 1000,4000,12000)")
    p.add_argument("--steps", type=int, default=None, help="decode steps per way and context (default 40)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", dest="json_out", default=None, help="write the measurements to this JSON file")
    args = p.parse_args(argv)
    threads = C.setup_torch(args.threads)
    C.warn_if_busy()
    import torch

    from hyserve import model_thread
    from hyserve.models.runtime import ModelRuntime

    size = "tiny" if args.quick else "bench"
    contexts = [int(c) for c in (args.contexts or ("300" if args.quick else "1000,4000,12000")).split(",")]
    steps = args.steps or (6 if args.quick else 40)
    rt = ModelRuntime.load(C.ensure_model("qwen3_5", size), device="cpu")
    ad = rt.adapter

    def measure(ctx: int) -> dict:
        ids = [3 + (k * 7) % (len(rt.tokenizer) - 3) for k in range(ctx)]
        st = ad.new_state()
        for i in range(0, ctx, 512):
            ad.forward(st, ids[i : i + 512])
        snap = ad.snapshot(st)
        concat, in_place = ad.restore(snap, ids), ad.restore(snap, ids)
        ta, tb, diff = [], [], 0.0
        for k in range(steps):
            tok = 5 + k % 50
            t0 = time.perf_counter()
            a = ad.forward(concat, [tok])
            ta.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            b = ad.forward_batch([in_place], [tok])[0]
            tb.append(time.perf_counter() - t0)
            diff = max(diff, float((a - b).abs().max()))
        ad.drop_batch()
        skip = min(2, steps - 1)  # the first in-place step copies the KV into its buffer
        return {
            "context": ctx,
            "concat_ms": statistics.median(ta[skip:]) * 1e3,
            "in_place_ms": statistics.median(tb[skip:]) * 1e3,
            "max_logit_diff": diff,
        }

    rows = [model_thread.run(measure, c) for c in contexts]
    print(
        f"qwen3_5 {size}, one request, median of {steps} alternating decode steps, torch {torch.__version__} "
        f"({threads} threads)"
    )
    print(context_table(rows))
    if args.json_out:
        out = Path(args.json_out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"machine": C.machine_info(), "size": size, "steps": steps, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

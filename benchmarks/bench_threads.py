"""Why hyserve runs all model work on one thread: the same forward pass, before and after a second
thread has run the model in the same process.

PyTorch's CPU kernels use OpenMP (libgomp), which keeps one worker pool per calling thread. A thread
that starts its pool while another thread's pool exists (so the pools together outnumber the cores)
gets one that barely spins between parallel regions: every one of the hundreds of small kernels in a
forward pass then pays a sleep and a wake-up. This script times a warm-turn prefill (restore a
~4.2k-token state, run 79 new tokens) and a one-token decode step:

1. on hyserve's model thread, the only thread that has run the model so far;
2. on a second thread (which now owns a second OpenMP pool);
3. on the model thread again.

Both threads run transformers' own functions, with denormals left on (HYSERVE_KERNELS=0,
HYSERVE_FLUSH_DENORMAL=0 are set here), since hyserve's kernels apply on the model thread only.

    python benchmarks/bench_threads.py            # bench qwen3_5, 7 repeats per row (~30 s)
    python benchmarks/bench_threads.py --quick    # tiny qwen3_5, a smoke test
    python benchmarks/bench_threads.py --json benchmarks/results/threads.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common as C  # noqa: E402


def where_table(rows: list[dict], new_tokens: int) -> str:
    """One row per place the same pass ran (the JSON's `rows`)."""
    return C.table(
        ["where", f"prefill {new_tokens} tok (ms)", "decode 1 tok (ms)"],
        [[r["where"], f"{r['prefill_ms']:.1f}", f"{r['decode_ms']:.1f}"] for r in rows],
    )


def main(argv=None) -> int:
    # hyserve's kernels and its denormal flushing apply on the model thread only; both threads compared here
    # must run the same code, so this script measures transformers' own functions on both (set before hyserve
    # is imported).
    os.environ["HYSERVE_KERNELS"] = "0"
    os.environ["HYSERVE_FLUSH_DENORMAL"] = "0"
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny model, 3 repeats")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", dest="json_out", default=None, help="write the measurements to this JSON file")
    args = p.parse_args(argv)
    threads = C.setup_torch(args.threads)
    C.warn_if_busy()
    import torch

    from hyserve import model_thread
    from hyserve.models.runtime import ModelRuntime

    size, context, new, reps = ("tiny", 400, 20, 3) if args.quick else ("bench", 4182, 79, 7)
    rt = ModelRuntime.load(C.ensure_model("qwen3_5", size), device="cpu")
    ad = rt.adapter
    ids = torch.randint(3, len(rt.tokenizer), (context + new,), generator=torch.Generator().manual_seed(0)).tolist()

    def build():
        st = ad.new_state()
        for i in range(0, context, 512):
            ad.forward(st, ids[i : min(context, i + 512)])
        return ad.snapshot(st)

    snap = model_thread.run(build)

    def timings() -> dict:
        prefill, decode = [], []
        for _ in range(reps):
            st = ad.restore(snap, ids[:context])
            t0 = time.perf_counter()
            ad.forward(st, ids[context:])
            prefill.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            ad.forward(st, [5])
            decode.append(time.perf_counter() - t0)
        return {"prefill_ms": statistics.median(prefill) * 1e3, "decode_ms": statistics.median(decode) * 1e3}

    rows = [("model thread, only torch thread so far", model_thread.run(timings))]
    other: dict = {}
    t = threading.Thread(target=lambda: other.update(timings()), name="second-thread")
    t.start()
    t.join()
    rows.append(("a second thread (its own OpenMP pool)", other))
    rows.append(("model thread again, after the second thread", model_thread.run(timings)))
    print(
        f"qwen3_5 {size}, {context}-token state, {new} new tokens, torch {torch.__version__} ({threads} threads), "
        f"median of {reps}"
    )
    print(where_table([{"where": n, **r} for n, r in rows], new))
    first, last = rows[0][1], rows[2][1]
    second = rows[1][1]
    print(
        f"second thread / model thread: prefill x{second['prefill_ms'] / first['prefill_ms']:.2f}, decode "
        f"x{second['decode_ms'] / first['decode_ms']:.2f}; model thread after / before the second thread: "
        f"prefill x{last['prefill_ms'] / first['prefill_ms']:.2f}, decode x{last['decode_ms'] / first['decode_ms']:.2f}"
    )
    if args.json_out:
        out = Path(args.json_out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(
            json.dumps(
                {
                    "machine": C.machine_info(),
                    "size": size,
                    "context": context,
                    "new_tokens": new,
                    "repeats": reps,
                    "rows": [{"where": n, **r} for n, r in rows],
                },
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

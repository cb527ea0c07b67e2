"""What idle time does to the next warm turn, on this machine.

A server waits between requests; a benchmark that waits for the server to go idle before each turn
(`bench_multiturn.py`, like a user reading the reply) times the turn after that wait. This script times the
same warm turn (restore a ~4.2k-token state, prefill 79 new tokens, argmax: what `bench_multiturn.py`'s bare
loop does) back to back, and after sleeping S seconds, on hyserve's model thread. Then it copies the
weights, which transformers leaves as views of the mmapped safetensors file, into anonymous memory and
times both again, since where the weights live is the first suspect for a slowdown after idle. Last,
two plain PyTorch operations without the model, the same way: the machine alone.

    python benchmarks/bench_idle.py                  # bench qwen3_5, sleeps 0, 0.05, 0.5, 2 s, medians of 7
    python benchmarks/bench_idle.py --quick          # tiny qwen3_5, a smoke test
    python benchmarks/bench_idle.py --json benchmarks/results/idle.json
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common as C  # noqa: E402

SLEEPS = (0.0, 0.05, 0.5, 2.0)


def after_idle(timed, sleeps, reps: int) -> dict[float, float]:
    """Median ms of `timed()` (seconds) right after each idle time in `sleeps` (0: back to back), after a
    warm-up."""
    for _ in range(3):
        timed()
    out = {}
    for s in sleeps:
        times = []
        for _ in range(reps):
            time.sleep(s)
            times.append(timed())
        out[s] = C.median(times) * 1e3
    return out


def warm_turn(rt, snap, prompt: list[int], cached: int):
    """The warm turn as a timed function: restore the snapshot, prefill the rest, argmax."""
    import torch

    ad = rt.adapter

    def warm() -> float:
        t0 = time.perf_counter()
        state = ad.restore(snap, prompt[:cached])
        int(torch.argmax(ad.forward(state, prompt[cached:])))
        return time.perf_counter() - t0

    return warm


def plain_ops(sleeps, reps: int) -> list[dict]:
    """The machine alone, no model: a product that stays in cache and a sum streamed from memory, timed the
    same way (mean of a few calls right after each idle time)."""
    import torch

    a, w = torch.randn(79, 512), torch.randn(1536, 512)  # 3 MB: stays in cache
    big = torch.randn(32 << 20)  # 128 MB: streamed from memory
    rows = []
    for name, fn, n in (
        ("(no model) 79x512 by 512x1536 product, in cache", lambda: a @ w.t(), 20),
        ("(no model) sum over 128 MB", lambda: big.sum(), 2),
    ):

        def timed(fn=fn, n=n) -> float:
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            return (time.perf_counter() - t0) / n

        rows.append({"weights": name, **after_idle(timed, sleeps, reps)})
    return rows


def run(rt, new: int, total: int, sleeps, reps: int) -> list[dict]:
    import torch

    ad = rt.adapter
    rng = random.Random(0)
    prompt = [rng.randrange(3, len(rt.tokenizer) - 1) for _ in range(total)]
    cached = total - new
    state = ad.new_state()
    for i in range(0, cached, 512):
        ad.forward(state, prompt[i : min(cached, i + 512)])
    snap = ad.snapshot(state)
    warm = warm_turn(rt, snap, prompt, cached)
    rows = [{"weights": "mmapped safetensors (as loaded)", **after_idle(warm, sleeps, reps)}]
    with torch.no_grad():
        for p in list(rt.model.parameters()) + list(rt.model.buffers()):
            p.data = p.data.clone()
    rows.append({"weights": "copied to anonymous memory", **after_idle(warm, sleeps, reps)})
    return rows + plain_ops(sleeps, reps)


def idle_table(rows: list[dict]) -> str:
    """Rows as in the JSON: `weights` and the median ms after each idle time, keyed by the seconds as text."""
    sleeps = [k for k in rows[0] if k != "weights"]
    headers = ["warm turn, weights / operation"] + [
        ("back to back" if float(s) == 0 else f"after {float(s):g} s idle") + " (ms)" for s in sleeps
    ]
    return C.table(headers, [[r["weights"]] + [f"{r[s]:.1f}" for s in sleeps] for r in rows])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny qwen3_5, short prompt, 3 repeats")
    p.add_argument("--reps", type=int, default=None, help="repeats per idle time (default 7; quick 3)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", dest="json_out", default=None)
    args = p.parse_args(argv)
    C.setup_torch(args.threads)
    from hyserve import model_thread
    from hyserve.models.runtime import ModelRuntime

    size = "tiny" if args.quick else "bench"
    rt = ModelRuntime.load(C.ensure_model("qwen3_5", size), device="cpu")
    reps = args.reps or (3 if args.quick else 7)
    sleeps = (0.0, 0.05) if args.quick else SLEEPS
    new, total = (16, 200) if args.quick else (79, 4258)
    rows = [{str(k): v for k, v in r.items()} for r in model_thread.run(run, rt, new, total, sleeps, reps)]
    table = idle_table(rows)
    print(f"warm turn: restore {total - new} tokens, prefill {new}, argmax; medians of {reps}")
    print(table)
    if args.json_out:
        C.write_result(args.json_out, "bench_idle.py", {"rows": rows, "table": table})
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Decode step time and memory of a model's own dtype against `--quantization int8` / `int4`, in one process,
interleaved.

The runtimes are loaded into this process (the dtype's first, then each scheme of `--schemes`) and their decode
steps are timed block by block in turn (`--blocks` blocks of `--steps` steps per side, one request after a
`--prompt`-token prompt, and a batch of `--batch` requests); the result is the median of the per-block ratios,
so that the machine's drift between blocks cancels. Memory: the bytes each model holds (its parameters and
buffers, exact) and the growth of this process's resident set over each load (approximate: the allocator may keep freed
pages).

    python benchmarks/bench_quant.py --size real-0.8b --dtype bfloat16 --json benchmarks/results/quant.json
    python benchmarks/bench_quant.py --size real-0.8b --dtype float32 --schemes int8
    python benchmarks/bench_quant.py --quick      # tiny model, a few blocks (tests)
"""

from __future__ import annotations

import gc
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common as C  # noqa: E402


def parse_args(argv=None):
    p = C.interleaved_parser(__doc__, "blocks")
    p.add_argument("--arch", default="qwen3_5")
    p.add_argument("--size", default="bench", help="a size of `hyserve make-tiny-model` (default bench)")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--steps", type=int, default=6, help="decode steps per block (default 6)")
    p.add_argument("--prompt", type=int, default=512, help="prompt tokens before decoding (default 512)")
    p.add_argument("--batch", type=int, default=4, help="requests of the batched rows (default 4)")
    p.add_argument("--schemes", default="int8,int4", help="quantizations to compare (default int8,int4)")
    return p.parse_args(argv)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def held_bytes(model) -> int:
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


def step_times(runtimes: dict, prompt: int, batch: int, blocks: int, steps: int) -> dict:
    """Seconds per decode step of `batch` requests for each runtime, alternating block by block."""
    from hyserve import model_thread

    def run():
        sides = {}
        for name, rt in runtimes.items():
            ad = rt.adapter
            vocab = min(rt.model.config.get_text_config().vocab_size, len(rt.tokenizer))
            states = [ad.new_state() for _ in range(batch)]
            for r, state in enumerate(states):
                ad.forward(state, [(17 * i + 3 + r) % vocab for i in range(prompt)])
            sides[name] = (ad, states, vocab)
        times = {name: [] for name in runtimes}
        for b in range(blocks):
            for name, (ad, states, vocab) in sides.items():
                ad.forward_batch(states, [1] * batch)  # the batch gathered before the clock starts
                t0 = time.perf_counter()
                for i in range(steps):
                    ad.forward_batch(states, [(b + i + r) % vocab for r in range(batch)])
                times[name].append((time.perf_counter() - t0) / steps)
        for ad, _, _ in sides.values():
            ad.drop_batch()
        return times

    return model_thread.run(run)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.quick:
        args.size, args.blocks, args.steps, args.prompt, args.batch = "tiny", 2, 2, 16, 2
    C.setup_torch(args.threads)
    from hyserve.models.runtime import ModelRuntime

    model_dir = C.ensure_model(args.arch, args.size)
    memory, runtimes = {}, {}
    schemes = [x for x in args.schemes.split(",") if x]
    for name, quantization in ((args.dtype, None), *((x, x) for x in schemes)):
        gc.collect()
        before = rss_bytes()
        rt = ModelRuntime.load(model_dir, dtype=args.dtype, device="cpu", quantization=quantization)
        gc.collect()
        runtimes[name] = rt
        memory[name] = {
            "held_bytes": held_bytes(rt.model),
            "rss_growth_bytes": rss_bytes() - before,
            "kernels": dict(rt.kernels.status),
        }
    rows = []
    for batch in sorted({1, args.batch}):
        times = step_times(runtimes, args.prompt, batch, args.blocks, args.steps)
        row = {"requests": batch, f"{args.dtype}_step_s": C.median(times[args.dtype])}
        for x in schemes:
            row[f"{x}_step_s"] = C.median(times[x])
            row[f"{x}_over_dtype"] = C.median_ratio(times[args.dtype], times[x])
        rows.append(row)
    result = {
        "arch": args.arch,
        "size": args.size,
        "dtype": args.dtype,
        "prompt_tokens": args.prompt,
        "blocks": args.blocks,
        "steps": args.steps,
        "rows": rows,
        "memory": memory,
    }
    headers = ["requests", f"{args.dtype} step (s)", *(h for x in schemes for h in (f"{x} step (s)", f"{x} / dtype"))]
    print(
        C.table(
            headers,
            [
                [
                    r["requests"],
                    C.fmt_s(r[f"{args.dtype}_step_s"], 4),
                    *(v for x in schemes for v in (C.fmt_s(r[f"{x}_step_s"], 4), C.fmt_ratio(r[f"{x}_over_dtype"]))),
                ]
                for r in rows
            ],
        )
    )
    print(
        C.table(
            ["weights", "held", "RSS growth at load"],
            [[k, v["held_bytes"], v["rss_growth_bytes"]] for k, v in memory.items()],
        )
    )
    if args.json_out:
        C.write_result(args.json_out, "bench_quant.py", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())

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

`--kernels` times the C products alone instead (`quant/products.c`, random weights of real-0.8b's shapes: its
projections and its 248k-row head; 1, 2, 4 and 8 rows), the products before the weight-stationary tiles (the
per-output loop kept as `q8_reference` / `q4_reference`) against the tiles, interleaved block by block:

    python benchmarks/bench_quant.py --kernels --json benchmarks/results/quant_kernels.json

`--kernels-decode` times whole decode steps of one quantized model (`--schemes`' first) with the one or the other
swapped into all its products, interleaved block by block:

    python benchmarks/bench_quant.py --kernels-decode --size real-0.8b --schemes int8 --batch 8

`--a8-kernels` times the products of `--quantization w8a8|w4a8` alone (`quant/a8_products.c` over the weights
interleaved as a model holds them, over the same weights row after row as before, and the PyTorch path it
replaced for long pieces: the input rounded, the weight dequantized, a float32 product), on random weights of
Qwen3.5-4B's shapes (`real-4b`: its MLP's up and down products and a square projection) in each format (w4a8's
Q6_0 head included), from one row (a decode step) to a 512-token prefill piece, bfloat16 activations, each call
on the next of enough copies of the weight that they stream from memory, interleaved block by block:

    python benchmarks/bench_quant.py --a8-kernels --json benchmarks/results/quant-a8-kernels.json
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
    p.add_argument("--kernels", action="store_true", help="time the C products alone, before and after the tiles")
    p.add_argument("--kernels-decode", action="store_true", help="decode steps, before and after the tiles")
    p.add_argument("--a8-kernels", action="store_true", help="the w8a8 / w4a8 C products against PyTorch's")
    return p.parse_args(argv)


# (n, k) of real-0.8b's products: attention and Gated DeltaNet projections, MLP up and down, the head
KERNEL_SHAPES = [(1024, 1024), (3584, 1024), (1024, 3584), (248320, 1024)]
KERNEL_ROWS = (1, 2, 4, 8)


def kernel_rows(schemes: list[str], shapes: list[tuple[int, int]], blocks: int, most_reps: int = 50) -> list[dict]:
    """Seconds of one call of the per-output reference ("before") and of the tiles ("after") per format, shape
    and row count: the median over `blocks` blocks, each side timed in turn within a block."""
    import torch

    from hyserve.quant import native as qnative

    lib, why = qnative.library()
    if lib is None:
        raise SystemExit(f"the C products do not build here: {why}")
    g = torch.Generator().manual_seed(0)
    threads = torch.get_num_threads()
    rows_out = []
    for scheme in schemes:
        prefix = "q4" if scheme == "int4" else "q8"
        sides = {"before": getattr(lib, f"{prefix}_reference"), "after": getattr(lib, f"{prefix}_products")}
        for n, k in shapes:
            if scheme == "int4":
                qs = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8)
            else:
                qs = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
            d = (torch.rand(n, k // 32, generator=g) * 1e-3).half()
            x = torch.randn(max(KERNEL_ROWS), k, generator=g)
            y = torch.empty(max(KERNEL_ROWS), n)
            reps = min(most_reps, max(1, 50_000_000 // (n * k)))  # calls per timing: a few ms on real shapes
            for rows in KERNEL_ROWS:
                args = (rows, n, k, x.data_ptr(), k, qs.data_ptr(), d.data_ptr(), y.data_ptr(), threads)
                times = {side: [] for side in sides}
                for _ in range(blocks):
                    for side, product in sides.items():
                        product(*args)  # its weight's first pages, and the threads, awake
                        t0 = time.perf_counter()
                        for _ in range(reps):
                            product(*args)
                        times[side].append((time.perf_counter() - t0) / reps)
                head = {"format": scheme, "n": n, "k": k, "rows": rows}
                rows_out.append(_two_sides(head, times, "after", "before", 2 * n * k * rows, "gflops"))
    return rows_out


def _two_sides(head: dict, times: dict, fast: str, slow: str, ops: int, rate: str) -> dict:
    """A kernel table's row: `head`, each side's median seconds and billions of `ops` a second (`{side}_{rate}`),
    and `speedup`, the median over blocks of slow's time over fast's."""
    row = dict(head)
    for side in (slow, fast):
        row[f"{side}_s"] = C.median(times[side])
    for side in (slow, fast):
        row[f"{side}_{rate}"] = ops / row[f"{side}_s"] / 1e9
    row["speedup"] = C.median_ratio(times[fast], times[slow])
    return row


def tiles_ab_times(rt, prompt: int, batch: int, blocks: int, steps: int) -> dict:
    """Seconds per decode step of `batch` requests of the runtime `rt` with its products running the per-output
    loop ("before") or the tiles ("after"), alternating block by block."""
    from hyserve import model_thread
    from hyserve.quant import native as qnative
    from hyserve.quant.layout import QuantLinear

    lib, _ = qnative.library()
    products = {id(m.native): m.native for m in rt.model.modules() if isinstance(m, QuantLinear) and m.native}
    if not products:
        raise SystemExit(f"no C products on: {dict(rt.kernels.status)}")

    def use(side: str) -> None:
        for p in products.values():
            prefix = "q4" if p.format == "q4_0" else "q8"
            p.product = getattr(lib, f"{prefix}_{'reference' if side == 'before' else 'products'}")

    def run():
        ad = rt.adapter
        vocab = min(rt.model.config.get_text_config().vocab_size, len(rt.tokenizer))
        states = [ad.new_state() for _ in range(batch)]
        for r, state in enumerate(states):
            ad.forward(state, [(17 * i + 3 + r) % vocab for i in range(prompt)])
        times = {"before": [], "after": []}
        for b in range(blocks):
            for side in times:
                use(side)
                ad.forward_batch(states, [1] * batch)
                t0 = time.perf_counter()
                for i in range(steps):
                    ad.forward_batch(states, [(b + i + r) % vocab for r in range(batch)])
                times[side].append((time.perf_counter() - t0) / steps)
        use("after")
        ad.drop_batch()
        return times

    return model_thread.run(run)


def kernels_decode_main(args) -> int:
    from hyserve.models.runtime import ModelRuntime

    scheme = args.schemes.split(",")[0]
    model_dir = C.ensure_model(args.arch, args.size)
    rt = ModelRuntime.load(model_dir, dtype=args.dtype, device="cpu", quantization=scheme)
    rows = []
    for batch in sorted({1, args.batch}):
        times = tiles_ab_times(rt, args.prompt, batch, args.blocks, args.steps)
        rows.append(
            {
                "requests": batch,
                "before_step_s": C.median(times["before"]),
                "after_step_s": C.median(times["after"]),
                "speedup": C.median_ratio(times["after"], times["before"]),
            }
        )
    print(f"decode steps of {args.size} {args.arch} at {scheme}: the per-output loop (before) and the tiles (after)")
    print(
        C.table(
            ["requests", "before step (s)", "after step (s)", "after / before"],
            [
                [
                    r["requests"],
                    C.fmt_s(r["before_step_s"], 4),
                    C.fmt_s(r["after_step_s"], 4),
                    C.fmt_ratio(r["speedup"]),
                ]
                for r in rows
            ],
        )
    )
    if args.json_out:
        result = {"arch": args.arch, "size": args.size, "dtype": args.dtype, "scheme": scheme, "rows": rows}
        C.write_result(args.json_out, "bench_quant.py", result)
    return 0


def kernels_main(args) -> int:
    from hyserve.quant import native as qnative

    schemes = [x for x in args.schemes.split(",") if x]
    shapes = [(40, 256), (8, 1024)] if args.quick else KERNEL_SHAPES
    rows = kernel_rows(schemes, shapes, 2 if args.quick else args.blocks, 3 if args.quick else 50)
    lib, _ = qnative.library()
    result = {"isa": qnative.ISAS[lib.q8_isa()], "threads": args.threads, "blocks": args.blocks, "rows": rows}
    print(f"C products, {result['isa']}, {args.threads} threads: before (per-output loop) and after (tiles)")
    print(
        C.table(
            ["format", "n x k", "rows", "before GFLOP/s", "after GFLOP/s", "after / before"],
            [
                [
                    r["format"],
                    f"{r['n']} x {r['k']}",
                    r["rows"],
                    f"{r['before_gflops']:.1f}",
                    f"{r['after_gflops']:.1f}",
                    C.fmt_ratio(r["speedup"]),
                ]
                for r in rows
            ],
        )
    )
    if args.json_out:
        C.write_result(args.json_out, "bench_quant.py", result)
    return 0


# (n, k) of real-4b's products: the MLP's up and down, a square projection; rows from a decode step to a piece
A8_SHAPES = [(9216, 2560), (2560, 9216), (2560, 2560)]
A8_ROWS = (1, 8, 64, 256, 512)
A8_FORMATS = {"int8": "w8a8", "int4": "w4a8", "int6": "w4a8 head"}  # each weight format, and what holds it
A8_STREAM = 256 << 20  # bytes of weights each side cycles through: more than the caches hold, as a model's step
A8_SIDES = ("interleaved", "rows", "torch")


def a8_kernels_main(args) -> int:
    """Seconds of one call of the C product over the weights as a model holds them (interleaved in sets of 8 rows,
    "interleaved"), over the same weights row after row ("rows", as before) and of PyTorch's rounded float32
    product ("torch") per format, shape and row count: the median over `--blocks` blocks, each side timed in turn
    within a block, each call on the next of enough copies of the weight to stream it from memory."""
    import torch

    from hyserve.quant import layout
    from hyserve.quant import native as qnative

    lib, why = qnative.a8_library()
    if lib is None:
        raise SystemExit(f"the C products do not build here: {why}")
    products = qnative.A8Products(lib)
    g = torch.Generator().manual_seed(0)
    shapes, row_counts = ([(40, 256), (16, 1024)], (1, 9)) if args.quick else (A8_SHAPES, A8_ROWS)
    blocks = 2 if args.quick else args.blocks
    rows_out = []
    for scheme, name in A8_FORMATS.items():
        for n, k in shapes:
            qs, d = layout.quantize(torch.randn(n, k, generator=g) * 0.05, scheme)
            copies = 1 if args.quick else -(-A8_STREAM // (qs.numel() + 2 * d.numel()))
            held = {"rows": [], "interleaved": []}
            for _ in range(copies):
                for side, layers in held.items():
                    layers.append(layout.QuantLinear(qs.clone(), d.clone(), None, torch.bfloat16))
                    if side == "interleaved":
                        layout.interleave_(layers[-1].qs, layers[-1].d)
                        layers[-1].interleaved = True
            for rows in row_counts:
                x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
                reps = max(1, min(50, 2_000_000_000 // (n * k * rows)))  # calls per timing: tens of ms
                times = {side: [] for side in A8_SIDES}
                with torch.inference_mode():
                    assert torch.equal(
                        _a8_call(products, "interleaved", x, held, 0), _a8_call(products, "rows", x, held, 0)
                    )
                    for _ in range(blocks):
                        for side in A8_SIDES:
                            _a8_call(products, side, x, held, 0)
                            t0 = time.perf_counter()
                            for i in range(reps):
                                _a8_call(products, side, x, held, i + 1)
                            times[side].append((time.perf_counter() - t0) / reps)
                row = {"format": name, "n": n, "k": k, "rows": rows}
                for side, seconds in times.items():
                    row[f"{side}_s"] = C.median(seconds)
                    row[f"{side}_gops"] = 2 * n * k * rows / row[f"{side}_s"] / 1e9
                row["vs_rows"] = C.median_ratio(times["interleaved"], times["rows"])
                row["vs_torch"] = C.median_ratio(times["interleaved"], times["torch"])
                rows_out.append(row)
                print(row, flush=True)
    result = {"isa": products.isa, "threads": args.threads, "blocks": blocks, "rows": rows_out}
    print(a8_table(result))
    if args.json_out:
        C.write_result(args.json_out, "bench_quant.py", result)
    return 0


def _a8_call(products, side: str, x, held: dict, i: int):
    """Call `i` of a side of `--a8-kernels`, on the i-th of its copies of the weight (`held`: per layout)."""
    from hyserve.quant import layout

    if side == "torch":
        layer = held["rows"][i % len(held["rows"])]
        return layout.dequantized_linear(x, layer.qs, layer.d, None, True)
    return products(x, held[side][i % len(held[side])])


def a8_table(result: dict) -> str:
    """The `--a8-kernels` table (bench_report's `quant-a8-kernels`)."""
    return C.table(
        [
            "weights",
            "n x k",
            "rows",
            "interleaved GOP/s",
            "rows GOP/s",
            "PyTorch GOP/s",
            "interleaved / rows speed",
            "interleaved / PyTorch speed",
        ],
        [
            [
                r["format"],
                f"{r['n']} x {r['k']}",
                r["rows"],
                f"{r['interleaved_gops']:.1f}",
                f"{r['rows_gops']:.1f}",
                f"{r['torch_gops']:.1f}",
                C.fmt_ratio(r["vs_rows"]),
                C.fmt_ratio(r["vs_torch"]),
            ]
            for r in result["rows"]
        ],
    )


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
    if args.kernels:
        C.setup_torch(args.threads)
        return kernels_main(args)
    if args.a8_kernels:
        C.setup_torch(args.threads)
        return a8_kernels_main(args)
    if args.quick:
        args.size, args.blocks, args.steps, args.prompt, args.batch = "tiny", 2, 2, 16, 2
    if args.kernels_decode:
        C.setup_torch(args.threads)
        return kernels_decode_main(args)
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

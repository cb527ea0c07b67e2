"""What hyserve's process settings and kernels buy, measured side by side against plain transformers.

Three variants, each in a fresh child process (the settings must be in place before the model
thread's first PyTorch operation), alternated round by round so that drift hits them alike:

- `reference`: transformers' own functions, denormal floats left on (HYSERVE_FLUSH_DENORMAL=0
  HYSERVE_KERNELS=0);
- `+ flush denormals`: the model thread flushes denormals to zero (hyserve.model_thread);
- `+ kernels` (hyserve's default): also GQA attention without KV copies and the batched Gated
  DeltaNet decode step (hyserve.kernels).

Each child, on hyserve's model thread: a cold prefill of a ~4.1k-token prompt in 512-token chunks,
a warm turn (restore that state, prefill 79 new tokens), and one decode step for 1 and 16 live states
of ~1k tokens. Greedy tokens of a short generation are compared across variants.

Then, on the model thread of this process, the pieces alone at the warm turn's shapes (`--micro` runs
only these): SDPA's flash kernel against `grouped_attention` (79 queries over 4.2k keys), transformers'
chunked Gated DeltaNet against `chunked_delta_rule` (79 tokens of one layer), and exp against
`safe_exp` on inputs whose exp underflows, (the machine's state) a 32 MB copy into fresh pages
against one into a kept buffer, a snapshot's copy into heap clones against one into a block mapped for it
alone (`state.caches.packed_clones`), and that copy into a block mapped afresh against one into a block an evicted
snapshot freed (`snapshot_blocks`).

    python benchmarks/bench_kernels.py                 # bench qwen3_5, 3 rounds (~2 minutes)
    python benchmarks/bench_kernels.py --quick         # tiny qwen3_5, 1 round, a smoke test
    python benchmarks/bench_kernels.py --micro         # only the pieces (~10 s)
    python benchmarks/bench_kernels.py --json benchmarks/results/kernels.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common as C  # noqa: E402

VARIANTS = [
    ("reference", {"HYSERVE_FLUSH_DENORMAL": "0", "HYSERVE_KERNELS": "0"}),
    ("+ flush denormals", {"HYSERVE_FLUSH_DENORMAL": "1", "HYSERVE_KERNELS": "0"}),
    ("+ kernels (default)", {"HYSERVE_FLUSH_DENORMAL": "1", "HYSERVE_KERNELS": "1"}),
]
METRICS = [
    ("cold_s", "cold prefill (s)"),
    ("warm_s", "warm-turn prefill (ms)"),
    ("decode1_s", "decode step, 1 state (ms)"),
    ("decode16_s", "decode step, 16 states (ms)"),
]


def child(size: str, threads: int) -> dict:
    """Runs in the child process: the timings of one variant."""
    import random

    C.setup_torch(threads)
    from hyserve import model_thread
    from hyserve.models.runtime import ModelRuntime

    rt = ModelRuntime.load(C.ensure_model("qwen3_5", size), device="cpu")
    ad = rt.adapter
    context, new, decode_ctx, reps = (400, 20, 100, 2) if size == "tiny" else (4121, 79, 1000, 5)
    text = C.text_of_tokens(rt.tokenizer, random.Random(0), context + new + 50)
    ids = rt.encode(text)[: context + new]

    def run() -> dict:
        import torch

        out = {"cold_s": [], "warm_s": [], "decode1_s": [], "decode16_s": []}
        for _ in range(max(1, reps // 2)):
            st = ad.new_state()
            t0 = time.perf_counter()
            for i in range(0, context, 512):
                ad.forward(st, ids[i : min(context, i + 512)])
            out["cold_s"].append(time.perf_counter() - t0)
        snap = ad.snapshot(st)
        for _ in range(reps):
            st = ad.restore(snap, ids[:context])
            t0 = time.perf_counter()
            ad.forward(st, ids[context:])
            out["warm_s"].append(time.perf_counter() - t0)
        greedy = []  # a short greedy generation from the warm state, to compare variants
        logits = ad.forward(ad.restore(snap, ids[:context]), ids[context:])
        st = ad.restore(snap, ids[:context])
        ad.forward(st, ids[context:])
        for _ in range(8):
            greedy.append(int(torch.argmax(logits)))
            logits = ad.forward_batch([st], [greedy[-1]])[0]
        base = ad.new_state()
        ad.forward(base, ids[:decode_ctx])
        short = ad.snapshot(base)
        for n, key in ((1, "decode1_s"), (16, "decode16_s")):
            states = []
            for i in range(n):
                s = ad.restore(short, ids[:decode_ctx])
                ad.forward(s, ids[decode_ctx : decode_ctx + i + 1])  # lengths differ, as in a real batch
                states.append(s)
            ad.drop_batch()
            for _ in range(3):
                ad.forward_batch(states, [5] * n)
            for _ in range(reps * 4):
                t0 = time.perf_counter()
                ad.forward_batch(states, [5] * n)
                out[key].append(time.perf_counter() - t0)
            ad.drop_batch()
        res = {k: C.median(v) for k, v in out.items()}
        res["greedy"] = greedy
        return res

    return model_thread.run(run)


def micro(rounds: int = 30) -> list[dict]:
    """The kernels alone at a warm turn's shapes (bench qwen3_5: 8 query heads, 2 KV heads, head size 64;
    Gated DeltaNet 4 key and 8 value heads), on this process's model thread. Median ms of `rounds`."""
    import torch
    import torch.nn.functional as F
    from transformers.models.qwen3_5 import modeling_qwen3_5

    from hyserve import kernels, model_thread
    from hyserve.state.caches import packed_clones
    from hyserve.state.snapshot_blocks import BLOCKS

    def ms(fn) -> float:
        for _ in range(3):
            fn()
        times = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return C.median(times) * 1e3

    def run() -> list[dict]:
        g = torch.Generator().manual_seed(0)
        rows = []
        new, prefix = 79, 4121
        q = torch.randn(1, new, 8, 64, generator=g).transpose(1, 2)
        k, v = torch.randn(1, 2, prefix + new, 64, generator=g), torch.randn(1, 2, prefix + new, 64, generator=g)
        mask = torch.ones(new, prefix + new, dtype=torch.bool).tril(prefix)[None, None]
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.125, enable_gqa=True)
        diff = (kernels.grouped_attention(q, k, v, mask, 0.125) - want).abs().max().item()
        rows.append(
            {
                "piece": "attention, 79 queries over 4200 keys",
                "reference": "SDPA flash (enable_gqa)",
                "reference_ms": ms(
                    lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.125, enable_gqa=True)
                ),
                "hyserve_ms": ms(lambda: kernels.grouped_attention(q, k, v, mask, 0.125)),
                "max_abs_diff": diff,
            }
        )
        # a decode step's attention: 8 rows of ~540 tokens at Qwen3.5-0.8B's heads (8 q / 2 KV x 256), bfloat16,
        # left padding masked per row; transformers hands SDPA the grouped heads (enable_gqa)
        qd = torch.randn(8, 8, 1, 256, generator=g).bfloat16()
        kd, vd = (torch.randn(8, 2, 540, 256, generator=g).bfloat16() for _ in range(2))
        md = torch.ones(8, 1, 1, 540, dtype=torch.bool)
        for i in range(8):
            md[i, ..., : 7 * i] = False
        gqa = lambda: F.scaled_dot_product_attention(qd, kd, vd, attn_mask=md, scale=0.0625, enable_gqa=True)  # noqa: E731
        dec = lambda: kernels.attention.decode_attention(qd, kd, vd, md, 0.0625)  # noqa: E731
        rows.append(
            {
                "piece": "decode attention, 8 rows x 540 keys, bfloat16",
                "reference": "SDPA flash (enable_gqa)",
                "reference_ms": ms(gqa),
                "hyserve_ms": ms(dec),
                "max_abs_diff": (dec().float() - gqa().transpose(1, 2).float()).abs().max().item(),
            }
        )
        chunked = modeling_qwen3_5.torch_chunk_gated_delta_rule
        chunked = getattr(chunked, "_hyserve_reference", chunked)
        r = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
        x = dict(
            query=r(1, new, 4, 64),
            key=r(1, new, 4, 64),
            value=r(1, new, 8, 64),
            g=-torch.rand(1, new, 8, generator=g) * 8,
            beta=torch.rand(1, new, 8, generator=g),
            initial_state=r(1, 8, 64, 64) * 0.3,
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )
        size = kernels.chunk_size_for(new)
        want_out, _ = chunked(**x, chunk_size=size)
        diff = (kernels.chunked_delta_rule(**x, chunk_size=size)[0] - want_out).abs().max().item()
        rows.append(
            {
                "piece": f"Gated DeltaNet prefill, {new} tokens, one {size}-token chunk",
                "reference": "transformers torch_chunk_gated_delta_rule",
                "reference_ms": ms(lambda: chunked(**x, chunk_size=size)),
                "hyserve_ms": ms(lambda: kernels.chunked_delta_rule(**x, chunk_size=size)),
                "max_abs_diff": diff,
            }
        )
        # a decode step's depthwise conv at real Qwen3.5-0.8B width (6,144 channels, 4 taps), in bfloat16
        w16, x16 = r(6144, 4).bfloat16(), r(1, 6144, 1).bfloat16()
        s16 = r(1, 6144, 4).bfloat16()

        def conv_reference(state):
            state.copy_(torch.cat([state[:, :, 1:], x16], dim=-1))
            return F.silu(F.conv1d(state, w16.unsqueeze(1), None, groups=6144)[..., -1:])

        want16 = conv_reference(s16.clone())
        rows.append(
            {
                "piece": "conv decode step, 6144 channels, bfloat16",
                "reference": "grouped F.conv1d",
                "reference_ms": ms(lambda: conv_reference(s16.clone())),
                "hyserve_ms": ms(lambda: kernels.conv_step(x16, s16.clone(), w16, None, "silu")),
                "max_abs_diff": (kernels.conv_step(x16, s16.clone(), w16, None, "silu") - want16).abs().max().item(),
            }
        )
        # one decode row through a bfloat16 weight of Qwen3.5-0.8B's MLP (3584 x 1024), plain against packed
        lin = torch.nn.Linear(1024, 3584, bias=False).bfloat16()
        row = r(1, 1024).bfloat16()
        from hyserve.kernels import linear as klinear

        if klinear.pack(lin):
            packed = lin.__dict__[klinear.PACKED].onednn
            rows.append(
                {
                    "piece": "decode row x bfloat16 weight 3584x1024",
                    "reference": "F.linear",
                    "reference_ms": ms(lambda: F.linear(row, lin.weight)),
                    "hyserve_ms": ms(lambda: torch.ops.mkldnn._linear_pointwise(row, packed, None, "none", [], "")),
                    "max_abs_diff": (
                        torch.ops.mkldnn._linear_pointwise(row, packed, None, "none", [], "")
                        - F.linear(row, lin.weight)
                    )
                    .abs()
                    .max()
                    .item(),
                }
            )
        low = torch.empty(8 * 80 * 80).uniform_(-300.0, -90.0, generator=g)  # exp underflows: a chunk's decays
        rows.append(
            {
                "piece": "exp of 51,200 values in [-300, -90]",
                "reference": "torch.exp",
                "reference_ms": ms(lambda: low.exp()),
                "hyserve_ms": ms(lambda: kernels.safe_exp(low)),
                "max_abs_diff": (kernels.safe_exp(low) - low.exp()).abs().max().item(),
            }
        )
        # the machine's cost of fresh memory, which hyserve's kept buffers (the grouped attention's scores, the
        # decode batch's rows) avoid: a copy into new pages faults every page in, a copy into a kept buffer not
        big = torch.randn(8 << 20, generator=g)
        kept = torch.empty_like(big)
        rows.append(
            {
                "piece": "copy of 32 MB (machine state)",
                "reference": "into a fresh buffer (clone)",
                "reference_ms": ms(lambda: big.clone()),
                "hyserve_ms": ms(lambda: kept.copy_(big)),
                "max_abs_diff": (kept - big).abs().max().item(),
            }
        )
        # a snapshot's copy (~4.2k-token bench qwen3_5 state: KV of 2 attention layers, conv and recurrent states
        # of 6 Gated DeltaNet layers) into heap clones, against one block mapped for it alone
        # (state.caches.packed_clones)
        state = (
            [r(1, 2, prefix + new, 64) for _ in range(4)]
            + [r(1, 8, 64, 64) for _ in range(6)]
            + [r(1, 1024, 4) for _ in range(6)]
        )
        mib = sum(t.numel() * t.element_size() for t in state) / 2**20
        rows.append(
            {
                "piece": f"snapshot copy of {mib:.1f} MiB",
                "reference": "heap clones (tensor.clone)",
                "reference_ms": ms(lambda: [t.clone() for t in state]),
                "hyserve_ms": ms(lambda: packed_clones(state)),
                "max_abs_diff": max((a - b).abs().max().item() for a, b in zip(packed_clones(state), state)),
            }
        )
        # the same copy into a block mapped afresh (every page faulted in), against one an evicted snapshot freed
        # (snapshot_blocks.BLOCKS: each copy above and below is dropped at once, so its block comes back)
        keep, BLOCKS.keep = BLOCKS.keep, 0
        afresh = ms(lambda: packed_clones(state))
        BLOCKS.keep = keep
        rows.append(
            {
                "piece": f"snapshot copy of {mib:.1f} MiB",
                "reference": "into a block mapped afresh",
                "reference_ms": afresh,
                "hyserve_ms": ms(lambda: packed_clones(state)),
                "max_abs_diff": max((a - b).abs().max().item() for a, b in zip(packed_clones(state), state)),
            }
        )
        return rows

    return model_thread.run(run)


def summary_table(summary: dict[str, dict]) -> str:
    """Medians per variant (the JSON's `summary`); (Nx) = speed against the first variant, the reference."""
    ref = next(iter(summary.values()))
    rows = []
    for name, s in summary.items():
        cells = [name]
        for k, _ in METRICS:
            cells.append(f"{s[k]:.3f}" if k == "cold_s" else f"{s[k] * 1e3:.1f}")
            cells[-1] += f" ({ref[k] / s[k]:.2f}x)" if s is not ref else ""
        cells.append(f"{s['cold_s'] / s['warm_s']:.1f}")
        rows.append(cells)
    return C.table(["variant"] + [h for _, h in METRICS] + ["cold / warm"], rows)


def micro_table(rows: list[dict]) -> str:
    return C.table(
        ["piece", "reference", "reference ms", "hyserve ms", "speedup", "max |diff|"],
        [
            [
                r["piece"],
                r["reference"],
                f"{r['reference_ms']:.3f}",
                f"{r['hyserve_ms']:.3f}",
                f"{r['reference_ms'] / r['hyserve_ms']:.2f}x",
                f"{r['max_abs_diff']:.1e}",
            ]
            for r in rows
        ],
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny model, 1 round")
    p.add_argument("--rounds", type=int, default=None, help="rounds of the three variants (default 3; quick 1)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", dest="json_out", default=None, help="write the measurements to this JSON file")
    p.add_argument("--micro", action="store_true", help="only the kernels alone at the warm turn's shapes")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.micro:
        C.setup_torch(args.threads)
        print(micro_table(micro()))
        return 0
    size = "tiny" if args.quick else "bench"
    if args.child:
        print("RESULT " + json.dumps(child(args.child, args.threads)))
        return 0
    C.ensure_model("qwen3_5", size)
    C.warn_if_busy()
    rounds = args.rounds or (1 if args.quick else 3)
    runs: dict[str, list[dict]] = {name: [] for name, _ in VARIANTS}
    for r in range(rounds):
        for name, env in VARIANTS:
            cmd = [sys.executable, __file__, "--child", size, "--threads", str(args.threads)]
            proc = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True, timeout=900)
            line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if proc.returncode != 0 or line is None:
                print(proc.stdout[-2000:], proc.stderr[-4000:], file=sys.stderr)
                return 1
            runs[name].append(json.loads(line[7:]))
            print(
                f"round {r + 1}/{rounds} {name}: "
                + ", ".join(f"{k} {runs[name][-1][k] * (1 if k == 'cold_s' else 1e3):.3g}" for k, _ in METRICS),
                flush=True,
            )
    summary = {name: {k: C.median(x[k] for x in rs) for k, _ in METRICS} for name, rs in runs.items()}
    print(f"qwen3_5 {size}, torch threads {args.threads}, medians over {rounds} round(s); (Nx) = speed vs reference")
    print(summary_table(summary))
    greedy = {name: rs[0]["greedy"] for name, rs in runs.items()}
    same = len({tuple(g) for g in greedy.values()}) == 1
    print(f"greedy tokens from the warm state identical across variants: {same}")
    C.setup_torch(args.threads)
    pieces = micro(5 if args.quick else 30)
    print("\nthe kernels alone, on this process's model thread (median ms):")
    print(micro_table(pieces))
    if args.json_out:
        out = Path(args.json_out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(
            json.dumps(
                {
                    "machine": C.machine_info(),
                    "size": size,
                    "rounds": rounds,
                    "runs": runs,
                    "summary": summary,
                    "greedy_identical": same,
                    "micro": pieces,
                },
                indent=2,
            )
        )
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())

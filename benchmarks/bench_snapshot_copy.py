"""A checkpoint's copy into a block mapped afresh against one into a recycled block, in one process, interleaved.

hyserve copies a checkpoint into a block of memory of its own (`state.caches.packed_clones`). A block mapped afresh
faults each page in as the copy writes it; `snapshot_blocks.BLOCKS` hands out again the blocks that evicted
checkpoints freed (and prepares spares while the engine idles), whose pages are already in place. Here one
request's state after a `--prompt`-token prompt (real-0.8b in bfloat16: the recurrent and conv states of 18
Gated DeltaNet layers and the KV of 6 attention layers) is snapshotted, then dropped as an eviction would,
`--blocks` times each way, alternating; the result is the median of the per-block ratios.

    python benchmarks/bench_snapshot_copy.py --json benchmarks/results/snapshot-copy.json
    python benchmarks/bench_snapshot_copy.py --quick      # tiny model (tests)
"""

from __future__ import annotations

import gc
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common as C  # noqa: E402


def parse_args(argv=None):
    p = C.interleaved_parser(__doc__, "snapshots")
    p.add_argument("--prompt", type=int, default=1088, help="prompt tokens before the snapshot (default 1088)")
    return p.parse_args(argv)


def copies(rt, prompt: int, blocks: int) -> dict:
    """Seconds per snapshot into blocks mapped afresh and into recycled ones, alternating."""
    from hyserve.state.snapshot_blocks import BLOCKS

    ad = rt.adapter
    vocab = min(rt.model.config.get_text_config().vocab_size, len(rt.tokenizer))
    state = ad.new_state()
    ad.forward(state, [(17 * i + 3) % vocab for i in range(prompt)])
    times: dict[str, list[float]] = {"afresh": [], "recycled": []}
    keep, min_bytes, nbytes = BLOCKS.keep, BLOCKS.min_bytes, 0
    BLOCKS.min_bytes = 0  # (the tiny model's blocks too)
    try:
        for _ in range(blocks + 1):  # the first round warms both paths up and is not counted
            for side in ("afresh", "recycled"):
                BLOCKS.keep = 0 if side == "afresh" else keep
                t0 = time.perf_counter()
                snap = ad.snapshot(state)
                times[side].append(time.perf_counter() - t0)
                nbytes = snap.nbytes
                del snap  # evicted: its block goes back to the OS, or to the pool
                gc.collect()
    finally:
        BLOCKS.keep, BLOCKS.min_bytes = keep, min_bytes
    afresh, recycled = times["afresh"][1:], times["recycled"][1:]
    return {
        "afresh_s": C.median(afresh),
        "recycled_s": C.median(recycled),
        "afresh_over_recycled": C.median_ratio(recycled, afresh),
        "snapshot_bytes": nbytes,
        "prompt_tokens": prompt,
        "blocks": blocks,
    }


def table(result: dict) -> str:
    c = result["copies"]
    row = [
        f"snapshot of {c['prompt_tokens']} tokens, {c['snapshot_bytes'] / 1e6:.1f} MB (ms)",
        f"{c['afresh_s'] * 1e3:.1f}",
        f"{c['recycled_s'] * 1e3:.1f}",
        f"{c['afresh_over_recycled']:.1f}x",
    ]
    headers = ["", "block mapped afresh", "recycled block", "afresh / recycled (median of per-block ratios)"]
    return C.table(headers, [row])


def main(argv=None) -> int:
    args = parse_args(argv)
    C.setup_torch(args.threads)
    from hyserve import model_thread
    from hyserve.models.runtime import ModelRuntime

    size = "tiny" if args.quick else "real-0.8b"
    rt = ModelRuntime.load(C.ensure_model("qwen3_5", size), dtype="bfloat16", device="cpu")
    prompt, blocks = (64, 3) if args.quick else (args.prompt, args.blocks)
    result = {"args": vars(args), "model": size, "copies": model_thread.run(copies, rt, prompt, blocks)}
    print(table(result))
    if args.json_out:
        C.write_result(args.json_out, "bench_snapshot_copy.py", result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

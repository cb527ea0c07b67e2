"""A decode step with and without each of its latest optimizations, measured in one process, interleaved.

This machine's speed drifts by tens of percent within a minute, more than either change is worth, so
columns measured in processes of their own (`bench_real.py --ab-env`) do not resolve them. Here both sides
run in the same process, block by block in turn, and the result is the median of the per-block ratios:

- the C products (`decode_step.c`'s `products`) against oneDNN's packed products, for every linear layer and the
  head: decode steps of 1 and of 4 requests after a 1,088-token prompt, blocks of `--steps` steps, in turn;
- the C Gated DeltaNet step (`kernels/decode_step.c`) against the PyTorch operations it replaces, and the lean
  decoder layers (`kernels/decode_layer.py`) against the layers' own forward (the same kernels inside): one
  request decoding after a 1,088-token prompt, blocks of `--steps` decode steps, the three in turn;
- the C decode attention (`decode_step.c`'s `decode_attention`) against SDPA, one request decoding after 1,088,
  8,000 and 16,000 tokens, 6 blocks each;
- with `--quantization w8a8,w4a8`, instead of the above: the decode layers in C over int8-activation quantized
  weights (`decode_layer.install_fused`) against the Python between the same C products, decode steps of 1 and of
  4 requests after a 1,088-token prompt, blocks of `--steps` steps, in turn, for each scheme;
- transparent huge pages (`allocator.request_huge_pages`) against 4 KiB pages: a weight of the size of the
  real-0.8b model's head (248,320 x 1,024 in bfloat16, 508 MB) placed on each with `madvise`, read through by
  a one-row bfloat16 product (PyTorch's own, which reads the weight where it lies; the packed copy a decode
  step uses is allocated by oneDNN's reorder, out of reach of `madvise` before its first touch).

    python benchmarks/bench_decode_step.py --json benchmarks/results/decode-step.json
    python benchmarks/bench_decode_step.py --quantization w8a8,w4a8 --json benchmarks/results/decode-step-a8.json
    python benchmarks/bench_decode_step.py --quick      # tiny model, a few blocks (tests)
"""

from __future__ import annotations

import ctypes
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common as C  # noqa: E402

MADV_HUGEPAGE, MADV_NOHUGEPAGE = 14, 15  # madvise advice (linux/mman.h)


def parse_args(argv=None):
    p = C.interleaved_parser(__doc__, "blocks")
    p.add_argument("--steps", type=int, default=6, help="decode steps per block (default 6)")
    p.add_argument(
        "--quantization",
        help="comma-separated int8-activation schemes (w8a8, w4a8): time the C decode layers over each instead",
    )
    return p.parse_args(argv)


def decode_layers(rt, prompt: int, blocks: int, steps: int) -> dict:
    """Seconds per decode step, alternating block by block: the lean layers with the C Gated DeltaNet step
    ("lean", as served), the lean layers with its PyTorch operations ("lean_torch"), the layers' own forward
    with the same kernels inside ("own")."""
    from hyserve.kernels import decode_layer

    layers = [m for m in rt.model.modules() if decode_layer.PARTS in m.__dict__]
    if not layers:
        return {"skipped": "no layer took the lean forward"}
    lean = {id(m): m.__dict__["forward"] for m in layers}
    native = {id(m): m.__dict__[decode_layer.PARTS].native for m in layers}
    ad = rt.adapter
    vocab = min(rt.model.config.get_text_config().vocab_size, len(rt.tokenizer))
    state = ad.new_state()
    ad.forward(state, [(17 * i + 3) % vocab for i in range(prompt)])
    ad.forward_batch([state], [1])
    sides = ("lean", "lean_torch", "own") if any(native.values()) else ("lean", "own")
    times: dict[str, list[float]] = {side: [] for side in sides}
    try:
        for b in range(blocks):
            for side in sides:
                for m in layers:
                    m.__dict__[decode_layer.PARTS].native = native[id(m)] if side == "lean" else None
                    if side == "own":
                        m.__dict__.pop("forward", None)
                    else:
                        m.__dict__["forward"] = lean[id(m)]
                t0 = time.perf_counter()
                for i in range(steps):
                    ad.forward_batch([state], [(b + i) % vocab])
                times[side].append((time.perf_counter() - t0) / steps)
    finally:
        for m in layers:
            m.__dict__["forward"] = lean[id(m)]
            m.__dict__[decode_layer.PARTS].native = native[id(m)]
        ad.drop_batch()
    out = {f"{side}_step_s": C.median(times[side]) for side in sides}
    out["own_over_lean"] = C.median_ratio(times["lean_torch" if "lean_torch" in times else "lean"], times["own"])
    if "lean_torch" in times:
        out["torch_over_native"] = C.median_ratio(times["lean"], times["lean_torch"])
    return {**out, "layers": len(layers), "prompt_tokens": prompt, "blocks": blocks, "steps": steps}


def _batches_in_turn(rt, prompt: int, batches: list[int], blocks: int, steps: int, sides: dict) -> list[dict]:
    """For each batch size of `batches`: that many requests after `prompt` tokens each, then blocks of `steps` decode
    steps, each side of `sides` (name: a function that switches the model to it) in turn block by block. Returns one
    row per batch size: `requests`, `<side>_step_s` (the median per step) and `<second>_over_<first>` (the median of
    the per-block ratios of the second side's time to the first's). The caller puts its model back."""
    ad = rt.adapter
    vocab = min(rt.model.config.get_text_config().vocab_size, len(rt.tokenizer))
    first, second = list(sides)
    rows = []
    for batch in batches:
        states = [ad.new_state() for _ in range(batch)]
        for r, state in enumerate(states):
            ad.forward(state, [(17 * i + 3 + r) % vocab for i in range(prompt)])
        ad.forward_batch(states, [1] * batch)
        times: dict[str, list[float]] = {side: [] for side in sides}
        for b in range(blocks):
            for side, switch in sides.items():
                switch()
                t0 = time.perf_counter()
                for i in range(steps):
                    ad.forward_batch(states, [(b + i + r) % vocab for r in range(batch)])
                times[side].append((time.perf_counter() - t0) / steps)
        ad.drop_batch()
        rows.append(
            {
                "requests": batch,
                **{f"{side}_step_s": C.median(t) for side, t in times.items()},
                f"{second}_over_{first}": C.median_ratio(times[first], times[second]),
            }
        )
    return rows


def decode_products(rt, prompt: int, batches: list[int], blocks: int, steps: int) -> dict:
    """Seconds per decode step of `batches` requests each, the C products (`native.Products`) against
    oneDNN's packed products (`linear.Packed.onednn`) for every packed weight, alternating block by block."""
    from hyserve.kernels import linear

    weights = [w for w in linear.every_packed(rt.model) if w.native is not None]
    if not weights:
        return {"skipped": "the C products are off"}
    native = weights[0].native

    def use(products):
        for w in weights:
            w.native = products

    try:
        rows = _batches_in_turn(
            rt, prompt, batches, blocks, steps, {"c": lambda: use(native), "onednn": lambda: use(None)}
        )
    finally:
        use(native)
    return {
        "rows": rows,
        "weights": len(weights),
        "weight_bytes": sum(w.plain.nbytes for w in weights),
        "prompt_tokens": prompt,
        "blocks": blocks,
        "steps": steps,
    }


def decode_fused(rt, prompt: int, batches: list[int], blocks: int, steps: int) -> dict:
    """Seconds per decode step of `batches` requests each over int8-activation quantized weights, alternating block
    by block: the decode layers in C (`decode_layer.install_fused`, as served: "c") and the Python between the same
    C products ("python")."""
    from hyserve.kernels import decode_layer

    parts = [m.__dict__[decode_layer.PARTS] for m in rt.model.modules() if decode_layer.PARTS in m.__dict__]
    held = {id(p): (p.fused, p.mlp_native) for p in parts}
    if not any(m is not None for _, m in held.values()):
        return {"skipped": "no layer took the C decode layers"}

    def use(c: bool):
        for p in parts:
            p.fused, p.mlp_native = held[id(p)] if c else (None, None)

    try:
        rows = _batches_in_turn(
            rt, prompt, batches, blocks, steps, {"c": lambda: use(True), "python": lambda: use(False)}
        )
    finally:
        use(True)
    return {
        "rows": rows,
        "gdn_layers": sum(f is not None for f, _ in held.values()),
        "mlp_blocks": sum(m is not None for _, m in held.values()),
        "prompt_tokens": prompt,
        "blocks": blocks,
        "steps": steps,
    }


def decode_attention(rt, contexts: list[int], blocks: int, steps: int) -> dict:
    """Seconds per decode step at each context length, the attention layers' C decode attention against SDPA
    (`kernels.attention.decode_attention`), alternating block by block."""
    from hyserve.kernels import attention

    layers = [m for m in rt.model.modules() if attention.NATIVE in m.__dict__]
    if not layers:
        return {"skipped": "no layer took the C decode attention"}
    kernel = {id(m): m.__dict__[attention.NATIVE] for m in layers}
    ad = rt.adapter
    vocab = min(rt.model.config.get_text_config().vocab_size, len(rt.tokenizer))
    rows = []
    try:
        for context in contexts:
            state = ad.new_state()
            ids = [(17 * i + 3) % vocab for i in range(context)]
            for i in range(0, context, 2048):
                ad.forward(state, ids[i : i + 2048])
            ad.forward_batch([state], [1])
            times: dict[str, list[float]] = {"c": [], "sdpa": []}
            for b in range(blocks):
                for side in times:
                    for m in layers:
                        if side == "c":
                            m.__dict__[attention.NATIVE] = kernel[id(m)]
                        else:
                            m.__dict__.pop(attention.NATIVE, None)
                    t0 = time.perf_counter()
                    for i in range(steps):
                        ad.forward_batch([state], [(b + i) % vocab])
                    times[side].append((time.perf_counter() - t0) / steps)
            ad.drop_batch()
            rows.append(
                {
                    "context": context,
                    "c_step_s": C.median(times["c"]),
                    "sdpa_step_s": C.median(times["sdpa"]),
                    "sdpa_over_c": C.median_ratio(times["c"], times["sdpa"]),
                }
            )
    finally:
        for m in layers:
            m.__dict__[attention.NATIVE] = kernel[id(m)]
    return {"rows": rows, "attention_layers": len(layers), "blocks": blocks, "steps": steps}


def _on_pages(nbytes: int, advice: int):
    """A bfloat16 [rows, 1024] tensor inside a buffer whose 2 MiB-aligned span got `advice` before first touch."""
    import torch

    libc = ctypes.CDLL(None)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    raw = torch.empty(nbytes + (4 << 20), dtype=torch.uint8)
    start = (raw.data_ptr() + (2 << 20) - 1) // (2 << 20) * (2 << 20)
    if libc.madvise(start, nbytes, advice) != 0:
        return None
    off = start - raw.data_ptr()
    return raw[off : off + nbytes].view(torch.bfloat16).view(-1, 1024)


def huge_pages(rows: int, blocks: int) -> dict:
    """Seconds of a one-row product over a [rows, 1024] bfloat16 weight on huge pages and on 4 KiB pages,
    alternating (oneDNN off, so that the product reads the weight in place)."""
    import torch

    from hyserve import allocator

    nbytes = rows * 1024 * 2
    huge, small = _on_pages(nbytes, MADV_HUGEPAGE), _on_pages(nbytes, MADV_NOHUGEPAGE)
    if huge is None or small is None:
        return {"skipped": "madvise refused"}
    g = torch.Generator().manual_seed(0)
    for w in (huge, small):
        w.copy_((torch.randn(rows, 1024, generator=g) * 0.02).to(torch.bfloat16))
    x = torch.randn(1, 1024, generator=g).to(torch.bfloat16)
    times: dict[str, list[float]] = {"huge": [], "small": []}
    with torch.inference_mode(), torch.backends.mkldnn.flags(enabled=False):
        for _ in range(blocks):
            for side, w in (("huge", huge), ("small", small)):
                t0 = time.perf_counter()
                torch.nn.functional.linear(x, w)
                times[side].append(time.perf_counter() - t0)
    return {
        "huge_s": C.median(times["huge"]),
        "small_s": C.median(times["small"]),
        "small_over_huge": C.median_ratio(times["huge"], times["small"]),
        "bytes": nbytes,
        "huge_page_bytes": allocator.huge_page_bytes(),
    }


def table(result: dict) -> str:
    if "decode_fused" in result:
        return fused_table(result)
    rows = []
    for r in result.get("decode_products", {}).get("rows", []):
        rows.append(
            [
                f"decode step, {r['requests']} request(s) after {result['decode_products']['prompt_tokens']} "
                "tokens (ms): C products / oneDNN's",
                f"{r['c_step_s'] * 1e3:.1f}",
                f"{r['onednn_step_s'] * 1e3:.1f}",
                f"{r['onednn_over_c']:.3f}x",
            ]
        )
    d = result["decode_layers"]
    if "skipped" not in d:
        step = f"decode step, one request after {d['prompt_tokens']} tokens (ms)"
        if "torch_over_native" in d:
            rows.append(
                [
                    f"{step}: C Gated DeltaNet step / its PyTorch operations",
                    f"{d['lean_step_s'] * 1e3:.1f}",
                    f"{d['lean_torch_step_s'] * 1e3:.1f}",
                    f"{d['torch_over_native']:.3f}x",
                ]
            )
            rows.append(
                [
                    f"{step}: lean layers / their own forward",
                    f"{d['lean_torch_step_s'] * 1e3:.1f}",
                    f"{d['own_step_s'] * 1e3:.1f}",
                    f"{d['own_over_lean']:.3f}x",
                ]
            )
        else:
            rows.append(
                [
                    f"{step}: lean layers / their own forward",
                    f"{d['lean_step_s'] * 1e3:.1f}",
                    f"{d['own_step_s'] * 1e3:.1f}",
                    f"{d['own_over_lean']:.3f}x",
                ]
            )
    for r in result.get("decode_attention", {}).get("rows", []):
        rows.append(
            [
                f"decode step, one request after {r['context']} tokens (ms): C decode attention / SDPA",
                f"{r['c_step_s'] * 1e3:.1f}",
                f"{r['sdpa_step_s'] * 1e3:.1f}",
                f"{r['sdpa_over_c']:.3f}x",
            ]
        )
    h = result["huge_pages"]
    if "skipped" not in h:
        rows.append(
            [
                f"the head's product over {h['bytes'] / 1e6:.0f} MB of weights: huge pages / 4 KiB pages (ms)",
                f"{h['huge_s'] * 1e3:.1f}",
                f"{h['small_s'] * 1e3:.1f}",
                f"{h['small_over_huge']:.3f}x",
            ]
        )
    return C.table(["", "with", "without", "without / with (median of per-block ratios)"], rows) + (
        "\n\nThe lean layers' row runs both sides with the Gated DeltaNet's PyTorch operations."
    )


def fused_table(result: dict) -> str:
    rows = []
    for scheme, d in result["decode_fused"].items():
        for r in d.get("rows", []):
            rows.append(
                [
                    f"decode step, {r['requests']} request(s) after {d['prompt_tokens']} tokens, {scheme} (ms): "
                    "C decode layers / Python between the C products",
                    f"{r['c_step_s'] * 1e3:.1f}",
                    f"{r['python_step_s'] * 1e3:.1f}",
                    f"{r['python_over_c']:.3f}x",
                ]
            )
    return C.table(["", "with", "without", "without / with (median of per-block ratios)"], rows)


def main(argv=None) -> int:
    args = parse_args(argv)
    C.setup_torch(args.threads)
    from hyserve import model_thread
    from hyserve.models.runtime import ModelRuntime

    size = "tiny" if args.quick else "real-0.8b"
    blocks = 3 if args.quick else args.blocks
    prompt = 64 if args.quick else 1088
    if args.quantization:
        result = {"args": vars(args), "model": size, "decode_fused": {}}
        for scheme in args.quantization.split(","):
            rt = ModelRuntime.load(C.ensure_model("qwen3_5", size), dtype="bfloat16", device="cpu", quantization=scheme)
            result["decode_fused"][scheme] = model_thread.run(decode_fused, rt, prompt, [1, 4], blocks, args.steps)
            del rt
        print(table(result))
        if args.json_out:
            C.write_result(args.json_out, "bench_decode_step.py", result)
        return 0
    rt = ModelRuntime.load(C.ensure_model("qwen3_5", size), dtype="bfloat16", device="cpu")
    result = {
        "args": vars(args),
        "model": size,
        "decode_products": model_thread.run(decode_products, rt, prompt, [1, 4], blocks, args.steps),
        "decode_layers": model_thread.run(decode_layers, rt, prompt, blocks, args.steps),
    }
    contexts = [64, 300] if args.quick else [1088, 8000, 16000]
    result["decode_attention"] = model_thread.run(
        decode_attention, rt, contexts, blocks if args.quick else 6, args.steps
    )
    del rt
    result["huge_pages"] = huge_pages(4096 if args.quick else 248320, blocks * (1 if args.quick else 3))
    print(table(result))
    if args.json_out:
        C.write_result(args.json_out, "bench_decode_step.py", result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Where a quantized server's memory goes, stage by stage: an in-process service with `bench_peers.py`'s hyserve
options (`--cache-bytes 2GiB`, the given dtype and `--quantization`), counted after each stage:

- `import`: torch, transformers and hyserve imported, nothing loaded;
- `load`: the service built (weights, the kernels' check, tokenizer, prefix cache, engine);
- `1 request`: one ~1050-token prompt and a 16-token reply (`bench_peers.py`'s cold prefill);
- `chat`: a 3-turn chat up to ~4200 prompt tokens (`bench_peers.py`'s chat);
- `8 concurrent`: 8 requests of ~1050 tokens at once (its throughput round);
- `trimmed`: then glibc's free heap pages handed back (`malloc_trim(0)`): what of the RSS was free heap.

Each row: anonymous and file-backed RSS, the peak RSS so far (VmHWM), the prefix cache's snapshots, the live
requests' states, every CPU tensor storage reachable (weights, snapshots, states), and glibc's heap (`in use`,
`free`) and blocks mapped one by one (`mmapped`).

    python benchmarks/bench_serve_memory.py benchmarks/.models/real-0.8b-qwen3_5 --dtype bfloat16 --quantization int8
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hyserve.allocator import keep_freed_memory  # noqa: E402

keep_freed_memory()  # as `hyserve serve`, before torch allocates

import bench_common as C  # noqa: E402
from bench_memory import glibc_heap, tensor_bytes  # noqa: E402


def status() -> dict:
    """This process's RssAnon, RssFile and VmHWM in bytes."""
    with open("/proc/self/status") as f:
        return {
            line.split(":")[0]: int(line.split()[1]) << 10
            for line in f
            if line.startswith(("RssAnon", "RssFile", "VmHWM"))
        }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_dir")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--quantization", default=None)
    p.add_argument("--cache-bytes", type=int, default=2 << 30)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompt-tokens", type=int, default=1050)
    p.add_argument("--max-tokens", type=int, default=16)
    args = p.parse_args(argv)
    C.setup_torch(args.threads)
    from hyserve.allocator import _malloc_trim
    from hyserve.engine import GenerationRequest
    from hyserve.service import ServiceConfig, build_service

    rows: list[tuple[str, dict]] = []
    service = None

    def sample(stage: str) -> None:
        gc.collect()
        row = {**status(), **(glibc_heap() or {}), "tensors": tensor_bytes()}
        if service is not None:
            row["cache"] = service.cache.stats()["bytes"]
            row["live"] = service.metrics.registry.get_sample_value("hyserve_live_state_bytes")
        rows.append((stage, row))
        print(stage, {k: f"{v / 2**20:.0f}" for k, v in row.items() if v is not None}, flush=True)

    sample("import")
    service = build_service(
        ServiceConfig(
            Path(args.model_dir),
            device="cpu",
            dtype=args.dtype,
            quantization=args.quantization,
            cache_bytes=args.cache_bytes,
        )
    )
    sample("load")
    engine, tok, rng = service.engine, service.runtime.tokenizer, random.Random(0)

    def ask(messages: list[dict]) -> str:
        chat = engine.render_chat(messages)
        return engine.generate(GenerationRequest(chat.prompt, args.max_tokens, messages=messages, chat=chat)).text

    ask([{"role": "user", "content": C.text_of_tokens(tok, rng, args.prompt_tokens)}])
    sample("1 request")
    messages = [{"role": "system", "content": C.text_of_tokens(tok, rng, 1000)}]
    for _ in range(3):
        messages.append({"role": "user", "content": C.text_of_tokens(tok, rng, 1000)})
        messages.append({"role": "assistant", "content": ask(messages)})
    sample("chat")
    prompts = [C.text_of_tokens(tok, random.Random(i), args.prompt_tokens) for i in range(8)]
    workers = [threading.Thread(target=ask, args=([{"role": "user", "content": t}],)) for t in prompts]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    sample("8 concurrent")
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
    sample("trimmed")
    engine.stop()
    mib = lambda b: "-" if b is None else f"{b / 2**20:.0f}"  # noqa: E731
    keys = ["RssAnon", "RssFile", "VmHWM", "cache", "live", "tensors", "in_use", "free", "mmapped"]
    print(f"{args.model_dir}, {args.dtype}, quantization {args.quantization}, cache {mib(args.cache_bytes)} MiB (MiB)")
    print(C.table(["stage", *keys], [[stage, *(mib(row.get(k)) for k in keys)] for stage, row in rows]))
    return 0


if __name__ == "__main__":
    sys.exit(main())

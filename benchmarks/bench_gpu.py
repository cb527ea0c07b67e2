"""The real-size table of bench_real.py on a CUDA GPU: cold prefill tokens/s, the warm turn, decode tokens/s
of one request and of 8 together, and the snapshot's size, for the 0.75B Qwen3.5 (`real-0.8b`) and the
Qwen3.5-35B-A3B-layout MoE (`real-moe`), in bfloat16 and float32, through hyserve's runtime on `--device
cuda` (hyserve's CPU kernels stay off there; transformers' own functions run, FLA's and causal-conv1d's
where they are installed).

A few minutes on a GPU machine (the models are built once under benchmarks/.models, ~3 GB each):

    python benchmarks/bench_gpu.py --json benchmarks/results/gpu.json

Without CUDA it says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common as C  # noqa: E402
import bench_real  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="real-0.8b,real-moe", help="comma-separated: real-0.8b, real-moe")
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--device", default="cuda", help="cuda or cuda:N")
    p.add_argument("--prompt", type=int, default=1024, help="cold prompt tokens (as bench_real.py)")
    p.add_argument("--decode", type=int, default=64, help="decode steps")
    p.add_argument("--batch", type=int, default=8, help="requests decoding together")
    p.add_argument("--quick", action="store_true", help="the tiny models, short prompt (seconds)")
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print(
            f"bench_gpu: no CUDA device (torch {torch.__version__}); nothing measured. Run it on a machine "
            "with an NVIDIA GPU and a CUDA build of torch."
        )
        return 0
    results = {}
    for model in args.models.split(","):
        cmd = [
            "--model",
            model,
            "--device",
            args.device,
            "--dtypes",
            args.dtypes,
            "--batch",
            str(args.batch),
            "--decode",
            str(args.decode if not args.quick else 4),
            "--json",
            "",
        ]
        if args.quick:
            cmd += ["--quick"]
        else:
            cmd += ["--prompt", str(args.prompt)]
        print(f"== {model} on {torch.cuda.get_device_name(torch.device(args.device))}", flush=True)
        results[model] = bench_real.run(bench_real.parse_args(cmd))
    if args.json:
        out = {
            "machine": {**C.machine_info(), "gpu": torch.cuda.get_device_name(torch.device(args.device))},
            "args": vars(args),
            "models": results,
        }
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

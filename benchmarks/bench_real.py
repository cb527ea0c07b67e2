"""Speed at a real size: a model at real dimensions (random weights) through hyserve's own runtime, float32
against bfloat16, and where the time goes.

`--model real-0.8b` (default) is `hyserve make-tiny-model --size real-0.8b`: a 0.75B-parameter Qwen3.5 (24
layers: 18 Gated DeltaNet + 6 full attention, hidden 1024, 248,320-token vocabulary, tied embeddings).
`--model real-moe` is `--size real-moe`: Qwen3.5-35B-A3B's layer at its real dimensions (hidden 2048, 8 routed
+ 1 shared experts of 512 per token) with 64 experts and 4 layers (3 Gated DeltaNet + 1 full attention),
1.46B parameters; `--experts eager,grouped_mm,batched_mm` measures each of transformers' experts
implementations (default: the one hyserve chooses at load). Models are built once under `benchmarks/.models`. Every
phase runs on hyserve's model thread through the family adapter, as the engine runs it (kernels on, after their
load-time check):

- cold prefill of `--prompt` tokens, in pieces of `--chunk` (the engine's prefill chunk);
- a snapshot of that state (its bytes);
- a warm turn: restore the snapshot and prefill `--new` tokens (what a chat's next turn costs);
- decode: `--decode` steps of one request (batched-decode path, one row), and of `--batch` requests decoding
  together (each restored from the snapshot; tokens/s over all of them);
- a gather of those `--batch` states into a decode batch, as the engine builds one when requests join or leave
  (the mean of 4, each while the one before is alive, after 2 that fault their memory in).

`--profile` adds PyTorch's profiler table of the top operators (self CPU time) for each phase. Numbers are
only comparable within one run on a quiet machine (two CPU-bound jobs on two cores slow each other far
more than 2x).

    python benchmarks/bench_real.py --json benchmarks/results/real.json
    python benchmarks/bench_real.py --profile --dtypes bfloat16
    python benchmarks/bench_real.py --model real-moe --experts eager,grouped_mm --json benchmarks/results/real-moe.json
    python benchmarks/bench_real.py --quick          # the tiny qwen3_5, a smoke test
    python benchmarks/bench_real.py --ab-env HYSERVE_MALLOC_KEEP=0   # also each dtype with freed memory
                                                     # handed back to the OS (hyserve.allocator)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common as C  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="real-0.8b", choices=sorted(MODELS), help="which real-size model")
    p.add_argument(
        "--experts",
        default=None,
        help="MoE only: experts implementations to measure, comma-separated (default: hyserve's choice)",
    )
    p.add_argument("--quick", action="store_true", help="the tiny model of the same family, short prompt (seconds)")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--prompt", type=int, default=None, help="cold prompt tokens (default 1024; quick 64)")
    p.add_argument("--new", type=int, default=64, help="new tokens of the warm turn")
    p.add_argument("--decode", type=int, default=None, help="decode steps (default 32; quick 4)")
    p.add_argument("--chunk", type=int, default=512, help="prefill piece (the engine's --prefill-chunk)")
    p.add_argument("--batch", type=int, default=8, help="requests decoding together in the batched decode row")
    p.add_argument("--device", default="cpu", help="cpu or cuda (benchmarks/bench_gpu.py runs this on a GPU)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--profile", action="store_true", help="PyTorch profiler: top operators per phase")
    p.add_argument(
        "--ab-env",
        action="append",
        default=[],
        metavar="VAR=VALUE",
        help="also measure each dtype in a child process with this environment (a column each)",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="with several columns: measure them round by round this many times; medians",
    )
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


MODELS = {"real-0.8b": "qwen3_5", "real-moe": "qwen3_5_moe"}  # size -> family


def model_dir(model: str, quick: bool) -> Path:
    arch = MODELS[model]
    if quick:
        return C.ensure_model(arch, "tiny")
    out = C.MODELS_DIR / f"{model}-{arch}"
    if not C._complete(out):
        from hyserve.testing.tiny import make_tiny_model

        print(f"building the {model} model in {out} (a few minutes, ~3 GB) ...", file=sys.stderr, flush=True)
        make_tiny_model(out, arch, size=model, force=True)
    return out


def measure(rt, args, prompt: int, decode: int) -> dict:
    """All phases, on the model thread (call through model_thread.run)."""
    import torch

    ad, vocab = rt.adapter, rt.model.config.get_text_config().vocab_size
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, min(vocab, len(rt.tokenizer)), (prompt + args.new + decode,), generator=g).tolist()
    profiles, out = {}, {}
    cuda = rt.model.device.type == "cuda"

    def run(name, fn):
        t0 = time.perf_counter()
        result = fn()
        if cuda:
            torch.cuda.synchronize()  # the phase's kernels have run, not only been queued
        out[name] = time.perf_counter() - t0
        return result

    def timed(name, fn):
        if not args.profile:
            return run(name, fn)
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
        with profile(activities=activities) as prof:
            result = run(name, fn)
        profiles[name] = prof.key_averages().table(
            sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total", row_limit=15
        )
        return result

    ad.forward(ad.new_state(), ids[:8])  # warm-up: first-call costs out of the way

    def cold():
        state = ad.new_state()
        for i in range(0, prompt, args.chunk):
            ad.forward(state, ids[i : min(prompt, i + args.chunk)])
        return state

    state = timed("cold_prefill_s", cold)
    snap = timed("snapshot_s", lambda: ad.snapshot(state))
    out["snapshot_mb"] = snap.nbytes / 1e6

    def warm():
        live = ad.restore(snap, ids[:prompt])
        ad.forward(live, ids[prompt : prompt + args.new])
        return live

    live = timed("warm_turn_s", warm)

    def steps():
        for t in ids[prompt + args.new :]:
            ad.forward_batch([live], [t])
        ad.drop_batch()

    ad.forward_batch([live], [ids[prompt + args.new - 1]])  # first-use costs (the batch's buffers) untimed, as
    ad.drop_batch()  # a server pays them once per batch, not per step
    live = ad.restore(snap, ids[:prompt])
    ad.forward(live, ids[prompt : prompt + args.new])
    timed("decode_s", steps)
    rows = [ad.restore(snap, ids[:prompt]) for _ in range(args.batch)]
    warm_rows = [ad.restore(snap, ids[:prompt]) for _ in range(args.batch)]
    ad.forward_batch(warm_rows, [ids[prompt]] * args.batch)
    ad.drop_batch()
    del warm_rows

    def batch_steps():
        for i in range(decode):
            ad.forward_batch(rows, [ids[(prompt + 7 * r + i) % len(ids)] for r in range(args.batch)])
        ad.drop_batch()

    timed("decode_batch_s", batch_steps)

    from hyserve.state.decode_batch import gather

    def gathers(n):  # as the engine regathers while the last batch is still alive: each into memory of its own
        batch = None
        for _ in range(n):
            batch = gather(rows, rt.model.config, rt.model.device)
        return batch

    gathers(2)  # the first two fault their memory in; later ones reuse what the one before last freed
    timed("gather_s", lambda: gathers(4))
    out["gather_s"] /= 4
    out.update(
        prompt_tokens=prompt,
        new_tokens=args.new,
        decode_steps=decode,
        batch=args.batch,
        cold_tok_s=prompt / out["cold_prefill_s"],
        decode_tok_s=decode / out["decode_s"],
        decode_batch_tok_s=decode * args.batch / out["decode_batch_s"],
        cold_over_warm=out["cold_prefill_s"] / out["warm_turn_s"],
        kernels=dict(rt.kernels.status),
    )
    if profiles:
        out["profiles"] = profiles
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # what a child of --ab-env repeats
    run(args)
    return 0


def run(args) -> dict:
    """Measure, print the table (and profiles), write `--json`; returns the result."""
    C.setup_torch(args.threads)
    prompt = args.prompt or (64 if args.quick else 1024)
    decode = args.decode or (4 if args.quick else 32)
    d = model_dir(args.model, args.quick)

    from hyserve import model_thread
    from hyserve.models import experts
    from hyserve.models.runtime import ModelRuntime

    rows = {}
    dtypes = args.dtypes.split(",")
    # every column in a process of its own when there are several (a bfloat16 model measured after a float32 one
    # in the same process ran its prefill ~30 % slower than in a fresh one); experts columns share their model
    isolate = (len(dtypes) > 1 or args.ab_env) and not args.experts and not args.profile
    if isolate:  # round by round over the columns, so that a drift of the machine's speed hits every column alike
        columns = [(dtype, env) for dtype in dtypes for env in ["", *args.ab_env]]
        got: dict = {c: [] for c in columns}
        for _ in range(args.rounds):
            for dtype, env in columns:
                got[dtype, env].append(_child_row(getattr(args, "argv", []), dtype, env))
        for (dtype, env), runs in got.items():
            rows[f"{dtype}, {env}" if env else dtype] = _median_row(runs)
        dtypes = []
    for dtype in dtypes:
        rt = ModelRuntime.load(d, dtype=dtype, device=args.device)
        for impl in args.experts.split(",") if args.experts else [None]:
            if impl is not None:
                model_thread.run(rt.model.set_experts_implementation, impl)
            name = dtype if impl is None else f"{dtype} {impl}"
            rows[name] = model_thread.run(measure, rt, args, prompt, decode)
            rows[name]["experts"] = experts.current(rt.model)
            for phase, text in rows[name].get("profiles", {}).items():
                print(f"\n== {name} {phase}\n{text}")
        del rt
        for env in args.ab_env:
            rows[f"{dtype}, {env}"] = _child_row(getattr(args, "argv", []), dtype, env)
    result = {"machine": C.machine_info(), "args": vars(args), "model": str(d), "rows": rows}
    print(table(result))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


def _median_row(runs: list[dict]) -> dict:
    """Each number's median over the rounds of one column (other fields from the first round)."""
    out = dict(runs[0], rounds=len(runs))
    for k, v in runs[0].items():
        if isinstance(v, float):
            out[k] = C.median([r[k] for r in runs])
    return out


def _child_row(argv, dtype: str, env: str) -> dict:
    """The same measurement of `dtype` in a child process whose environment adds `env` (VAR=VALUE, or "")."""
    import os
    import subprocess
    import tempfile

    var, _, value = env.partition("=")
    extra = {var: value} if var else {}
    rest, skip = [], False
    for a in argv:  # drop --json/--ab-env/--dtypes/--rounds and their values
        if skip:
            skip = False
        elif a in ("--json", "--ab-env", "--dtypes", "--rounds"):
            skip = True
        elif not a.startswith(("--json=", "--ab-env=", "--dtypes=", "--rounds=")):
            rest.append(a)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "row.json"
        subprocess.run(
            [sys.executable, __file__, *rest, "--dtypes", dtype, "--json", str(out)],
            env={**os.environ, **extra},
            check=True,
        )
        return next(iter(json.loads(out.read_text())["rows"].values()))


def table(result: dict) -> str:
    rows = result["rows"]
    names = list(rows)
    r0 = rows[names[0]]
    spec = [
        (f"cold prefill, {r0['prompt_tokens']} tokens (s)", "cold_prefill_s", C.fmt_s),
        ("cold prefill (tokens/s)", "cold_tok_s", lambda x: f"{x:.0f}"),
        (f"warm turn: restore + {r0['new_tokens']} new tokens (s)", "warm_turn_s", C.fmt_s),
        ("cold prefill of the prompt / warm turn", "cold_over_warm", lambda x: f"{x:.1f}x"),
        (f"decode, one request (tokens/s, {r0['decode_steps']} steps)", "decode_tok_s", lambda x: f"{x:.1f}"),
        (f"decode, {r0.get('batch')} requests together (tokens/s)", "decode_batch_tok_s", lambda x: f"{x:.1f}"),
        (f"snapshot at {r0['prompt_tokens']} tokens (MB)", "snapshot_mb", lambda x: f"{x:.1f}"),
        ("snapshot copy (s)", "snapshot_s", C.fmt_s),
        (f"gather of {r0.get('batch')} requests into a decode batch (s)", "gather_s", C.fmt_s),
    ]
    spec = [row for row in spec if row[1] in r0]  # (results measured before a row was added lack it)
    return C.table(["", *names], [[label, *(fmt(rows[n][key]) for n in names)] for label, key, fmt in spec])


if __name__ == "__main__":
    sys.exit(main())

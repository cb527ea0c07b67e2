"""Memory of loading a model folder and quantizing it (`--quantization`), as `ModelRuntime._load` does: the
process's anonymous and file-backed RSS after the load (each weight quantized as it is loaded, `quant.loading`;
in a checkout from before it, transformers' plain load) and after `quant.apply`, the peak of anonymous memory
(sampled every 20 ms) and the peak RSS (VmHWM: the checkpoint's mapped pages count there) across both.

    hyserve make-tiny-model /tmp/real08 --size real-0.8b
    python benchmarks/bench_quant_load.py /tmp/real08 int8 bfloat16

Run it with another checkout's `src` on PYTHONPATH to compare two versions. A float32 checkpoint loaded as
float32 is memory-mapped by transformers: its pages show as file-backed (page cache), not anonymous.
"""

from __future__ import annotations

import resource
import sys
import threading
import time
from pathlib import Path

from hyserve.allocator import free_heap_bytes, keep_freed_memory

keep_freed_memory()  # as ModelRuntime.load, before any big allocation

import torch  # noqa: E402 (after keep_freed_memory, on purpose)
from transformers import AutoModelForCausalLM  # noqa: E402

from hyserve import quant  # noqa: E402

try:
    from hyserve.quant import loading  # noqa: E402
except ImportError:
    loading = None


def rss() -> tuple[int, int]:
    """(anonymous, file-backed) resident MiB of this process."""
    with open("/proc/self/status") as status:
        fields = {
            line.split(":")[0]: int(line.split()[1]) // 1024
            for line in status
            if line.startswith(("RssAnon", "RssFile"))
        }
    return fields["RssAnon"], fields["RssFile"]


def main(model_dir: str, scheme: str = "int8", dtype: str = "bfloat16") -> None:
    peak = [0]

    def sample() -> None:
        while True:
            peak[0] = max(peak[0], rss()[0])
            time.sleep(0.02)

    threading.Thread(target=sample, daemon=True).start()
    start = time.perf_counter()
    if loading is None:  # a checkout from before `quant.loading`: the whole float model, then `apply`
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype), local_files_only=True)
        held = None
    else:
        model, made = loading.load(Path(model_dir), getattr(torch, dtype), scheme)
        held = made.held
    anon, file = rss()
    print(
        f"after load ({dtype}, {'quantized while loading' if held else 'float'}, {time.perf_counter() - start:.1f} s): "
        f"anon {anon} MiB, file {file} MiB, peak anon {peak[0]} MiB",
        flush=True,
    )
    done = quant.apply(model.eval(), scheme, held) if held else quant.apply(model.eval(), scheme)
    del held
    anon, file = rss()
    print(
        f"after quantize ({time.perf_counter() - start:.1f} s): anon {anon} MiB, file {file} MiB, peak anon "
        f"{peak[0]} MiB, VmHWM (anon and file) {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024} MiB: "
        f"{done.describe()}",
        flush=True,
    )
    if (free := free_heap_bytes()) is not None:
        print(f"free heap: {free >> 20} MiB (handed back at the end of a server's load: `allocator.hand_back_freed`)")


if __name__ == "__main__":
    main(*sys.argv[1:])

"""Memory of loading a model folder and quantizing it (`--quantization`), as `ModelRuntime._load` does: the
process's anonymous and file-backed RSS after transformers' load and after `quant.apply`, and the peak of
anonymous memory (sampled every 20 ms) across both.

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

from hyserve.allocator import keep_freed_memory

keep_freed_memory()  # as ModelRuntime.load, before any big allocation

import torch  # noqa: E402 (after keep_freed_memory, on purpose)
from transformers import AutoModelForCausalLM  # noqa: E402

from hyserve import quant  # noqa: E402


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
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype), local_files_only=True).eval()
    anon, file = rss()
    print(f"after load ({dtype}): anon {anon} MiB, file {file} MiB, peak anon {peak[0]} MiB", flush=True)
    done = quant.apply(model, scheme)
    anon, file = rss()
    print(
        f"after quantize: anon {anon} MiB, file {file} MiB, peak anon {peak[0]} MiB, VmHWM "
        f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024} MiB: {done.describe()}",
        flush=True,
    )


if __name__ == "__main__":
    main(*sys.argv[1:])

"""How torch's OpenMP workers wait between parallel regions: spinning, not asleep, for a while.

A decode step runs about a hundred parallel products (one a linear layer) with a few hundred small
single-threaded operations between them. Left to libgomp's defaults, the second worker is asleep when each
product starts and must be woken, and a one-request step of a 0.75B Qwen3.5 in bfloat16 took about 48 ms
where, with the workers spinning, it takes about 37 (`benchmarks/bench_real.py --ab-env HYSERVE_OMP_ACTIVE=0`
measures both). libgomp reads its settings from the
environment once, as it loads with torch, so `wait_actively` must run before torch is first imported; it
then takes them out of the environment again, so that processes started later (a llama-server a benchmark
compares against, anything a user runs) get their own defaults. The spin is bounded (`SPIN` iterations, some
tens of milliseconds), so an idle server's workers still go to sleep. A user's own `OMP_WAIT_POLICY` or
`GOMP_SPINCOUNT` is left alone; `HYSERVE_OMP_ACTIVE=0` keeps libgomp's defaults.
"""

from __future__ import annotations

import importlib
import os
import sys

SPIN = 1_000_000  # libgomp busy-wait iterations before a worker sleeps
VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def wait_actively() -> bool:
    """Import torch with OpenMP workers that spin between regions; returns whether the setting applied (False
    when torch was already imported, the user set either variable or HYSERVE_OMP_ACTIVE=0)."""
    if ("torch" in sys.modules or any(v in os.environ for v in VARS)
            or os.environ.get("HYSERVE_OMP_ACTIVE", "1") == "0"):
        return False
    os.environ.update(OMP_WAIT_POLICY="ACTIVE", GOMP_SPINCOUNT=str(SPIN))
    try:
        importlib.import_module("torch")  # libgomp reads the variables as it loads
    finally:
        for v in VARS:
            os.environ.pop(v, None)
    return True

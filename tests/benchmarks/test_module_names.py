"""`python benchmarks/X.py` puts benchmarks/ first on sys.path, so a script named like an installed module
(e.g. `kernels`, which transformers imports) would shadow it for the whole run. Every module in benchmarks/
carries the `bench_` prefix and none is importable from anywhere else."""

import importlib.machinery
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
MODULES = sorted(p.stem for p in BENCH.glob("*.py"))


def test_benchmark_modules_share_the_bench_prefix():
    assert MODULES and [m for m in MODULES if not m.startswith("bench_")] == []


def test_no_benchmark_module_shadows_an_importable_module():
    path = [p for p in sys.path if Path(p or ".").resolve() != BENCH]
    clashes = {
        m: spec.origin
        for m in MODULES
        if m in sys.builtin_module_names or (spec := importlib.machinery.PathFinder.find_spec(m, path)) is not None
    }
    assert clashes == {}

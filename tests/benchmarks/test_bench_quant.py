"""benchmarks/bench_quant.py --quick runs and writes its result for both schemes (no timing asserts)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _quick(tmp_path, *args: str) -> dict:
    """The result `bench_quant.py --quick *args` writes."""
    out = tmp_path / "quant.json"
    r = subprocess.run(
        [sys.executable, "benchmarks/bench_quant.py", "--quick", *args, "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return json.loads(out.read_text())


def test_quant_quick_writes_every_side(tmp_path):
    result = _quick(tmp_path)
    assert [row["requests"] for row in result["rows"]] == [1, 2]
    assert all(row[f"{x}_step_s"] > 0 for row in result["rows"] for x in ("bfloat16", "int8", "int4"))
    memory = result["memory"]
    assert memory["int4"]["held_bytes"] < memory["int8"]["held_bytes"] < memory["bfloat16"]["held_bytes"]
    assert memory["int8"]["kernels"]["native_int8"] == "on" and memory["int4"]["kernels"]["native_int4"] == "on"
    assert result["command"].startswith("python benchmarks/bench_quant.py --quick")


def test_a8_kernels_quick_times_both_sides(tmp_path):
    """`--a8-kernels --quick`: each format, shape and row count timed on every side, and bench_report's table."""
    result = _quick(tmp_path, "--a8-kernels")
    assert [(row["format"], row["rows"]) for row in result["rows"]] == [
        (f, rows) for f in ("w8a8", "w4a8", "w4a8 head") for _ in range(2) for rows in (1, 9)
    ]
    assert all(row[f"{side}_s"] > 0 for row in result["rows"] for side in ("interleaved", "rows", "torch"))
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_report

    table = bench_report.quant_a8_kernels(result)
    assert "interleaved / rows speed" in table and len(table.splitlines()) == 2 + len(result["rows"])

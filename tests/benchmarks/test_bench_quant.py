"""benchmarks/bench_quant.py --quick runs and writes its result for both schemes (no timing asserts)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_quant_quick_writes_every_side(tmp_path):
    out = tmp_path / "quant.json"
    r = subprocess.run(
        [sys.executable, "benchmarks/bench_quant.py", "--quick", "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    result = json.loads(out.read_text())
    assert [row["requests"] for row in result["rows"]] == [1, 2]
    assert all(row[f"{x}_step_s"] > 0 for row in result["rows"] for x in ("bfloat16", "int8", "int4"))
    memory = result["memory"]
    assert memory["int4"]["held_bytes"] < memory["int8"]["held_bytes"] < memory["bfloat16"]["held_bytes"]
    assert memory["int8"]["kernels"]["native_int8"] == "on" and memory["int4"]["kernels"]["native_int4"] == "on"
    assert result["command"].startswith("python benchmarks/bench_quant.py --quick")

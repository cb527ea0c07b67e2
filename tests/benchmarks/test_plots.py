"""The plots of docs/benchmarks.md draw the committed results: their series (docs/img/NAME.json) are what
benchmarks/bench_plots.py extracts from benchmarks/results/, and a changed result makes them stale."""

import json
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_plots  # noqa: E402

RESULTS, IMG = ROOT / "benchmarks" / "results", ROOT / "docs" / "img"


@pytest.mark.parametrize("name", sorted(bench_plots.PLOTS))
def test_committed_series_are_the_results(name):
    data = bench_plots.PLOTS[name](RESULTS)
    assert data is not None, f"{name}: its result files are missing"
    assert json.loads((IMG / f"{name}.json").read_text()) == data, "rerun python benchmarks/bench_report.py --write"
    assert (IMG / f"{name}.png").is_file()
    assert bench_plots.stale(RESULTS, IMG) == []


def test_a_changed_result_makes_its_plot_stale_and_write_redraws_it(tmp_path):
    results, img = tmp_path / "results", tmp_path / "img"
    results.mkdir()
    for name in ("peers-real-chat.json", "agent.json", "peers-real.json", *(n for n, _ in bench_plots.QUANT_RUNS)):
        shutil.copyfile(RESULTS / name, results / name)
    assert sorted(bench_plots.write(results, img)) == sorted(bench_plots.PLOTS)
    assert bench_plots.stale(results, img) == []
    chat = json.loads((results / "peers-real-chat.json").read_text())
    chat["turns"][-1]["llama"]["ttft"] += 1.0
    (results / "peers-real-chat.json").write_text(json.dumps(chat))
    assert bench_plots.stale(results, img) == ["ttft_vs_history"]
    bench_plots.write(results, img)
    assert bench_plots.stale(results, img) == [] and (img / "ttft_vs_history.png").stat().st_size > 10_000


def test_the_summary_has_a_row_for_every_headline_result(tmp_path):
    import bench_report

    assert len(bench_report.summary_rows(RESULTS)) == len(bench_report.SUMMARY_FILES)
    shutil.copyfile(RESULTS / "quality.json", tmp_path / "quality.json")  # one file: its row alone
    (row,) = bench_report.summary_rows(tmp_path)
    assert row[0].startswith("quantized weights") and "int8 98.2%" in row[1]
    assert bench_report.summary_rows(tmp_path / "none") == []

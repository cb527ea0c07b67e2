"""benchmarks/bench_llama_quant.py: the quantized peer's table against issue 37's targets, the warm-turn figure
and where llama-quantize is looked for (the end-to-end run with llama.cpp is in test_quick_modes.py)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_llama_quant as Q


def _turn(ttft, total, tokens):
    return {"ttft": ttft, "total": total, "completion_tokens": tokens}


def _result(hy: dict, llama: dict, hy_turn, ll_turn) -> dict:
    """A `bench_peers.py --quantization int4` result holding what the table reads, for one llama.cpp type."""
    cold = {"turn": 1, "hyserve": _turn(9.0, 9.0, 1), "llama": _turn(9.0, 9.0, 1)}
    warm = {"turn": 2, "hyserve": hy_turn, "llama": ll_turn}
    return {
        "quantization": {"scheme": "int4", "types": {"Q4_0": {}}},
        "throughput": {"hyserve": hy, "peers": {"Q4_0": llama}},
        "peers_chat": {"Q4_0": {"turns": [cold, warm]}},
    }


def test_warm_turn_is_ttft_plus_256_tokens_at_the_replys_pace_over_warm_turns_only():
    turns = [
        {"hyserve": _turn(5.0, 6.0, 11)},  # turn 1 (cold) is left out
        {"hyserve": _turn(1.0, 2.0, 11)},  # 0.1 s a token: 1 + 25.6
        {"hyserve": _turn(1.0, 1.5, 1)},
    ]  # one token: no pace to take, left out
    assert Q.warm_turn_s(turns, "hyserve") == pytest.approx(26.6)
    assert Q.warm_turn_s(turns[:1], "hyserve") is None


def test_table_marks_each_target_met_or_missed_in_its_direction():
    hy = {"decode_tok_s": 20.0, "concurrent_tok_s": 60.0, "cold_tok_s": 100.0, "memory_mib": {"VmHWM": 1000.0}}
    llama = {"decode_tok_s": 10.0, "concurrent_tok_s": 50.0, "cold_tok_s": 200.0, "memory_mib": {"VmHWM": 2000.0}}
    hy["memory_mib"]["VmRSS"], hy["prompt_cache_mib"] = 900.0, 600.0  # 300 MiB apart from the cache
    llama["memory_mib"]["VmRSS"], llama["prompt_cache_mib"] = 2000.0, 1500.0  # 500
    # hyserve's warm turn 1 + 256 * 0.01 = 3.56 s, llama's 2 + 256 * 0.1 = 27.6 s
    text = Q.quant_table(_result(hy, llama, _turn(1.0, 1.1, 11), _turn(2.0, 3.0, 11)))
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]] for line in text.splitlines()[2:]}
    assert rows["decode, 1 request (tokens/s)"] == ["20.0", "10.0", "2.00x (met)", ">= 1.0x"]
    assert rows["decode, concurrent requests (tokens/s, all)"][2] == "1.20x (missed)"  # target 1.3x
    assert rows["cold prefill (tokens/s)"][2] == "0.50x (missed)"
    assert rows["peak resident memory (MiB)"] == ["1000.0", "2000.0", "0.50x (met)", "<= 1.1x"]
    assert rows["resident memory less the prompt cache (MiB)"] == ["300.0", "500.0", "0.60x (met)", "<= 1.1x"]
    assert rows["warm turn: TTFT + 256 tokens (s)"][2] == f"{3.56 / 27.6:.2f}x (met)"


def test_a_missing_measurement_shows_a_dash_not_a_ratio():
    text = Q.quant_table(
        {"quantization": {"scheme": "int8", "types": {"Q8_0": {}}}, "throughput": None, "peers_chat": {}}
    )
    rows = [[c.strip() for c in line.split("|")[2:-1]] for line in text.splitlines()[2:]]
    assert len(rows) == len(Q.TARGETS) and all(row[:3] == ["-", "-", "-"] for row in rows)


def test_llama_quantize_is_found_beside_llama_server_or_where_it_is_named(tmp_path, monkeypatch):
    monkeypatch.delenv("LLAMA_QUANTIZE", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    (tmp_path / "bin").mkdir()
    server, quantize = tmp_path / "bin" / "llama-server", tmp_path / "bin" / "llama-quantize"
    server.write_text("")
    assert Q.find_llama_quantize(None, str(server)) is None
    quantize.write_text("")
    assert Q.find_llama_quantize(None, str(server)) == str(quantize)
    assert Q.find_llama_quantize(str(tmp_path / "nothing"), str(server)) is None  # a wrong explicit path is not
    monkeypatch.setenv("LLAMA_QUANTIZE", str(quantize))  # silently replaced
    assert Q.find_llama_quantize(None, None) == str(quantize)

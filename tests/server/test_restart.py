"""A real `hyserve serve --cache-dir` killed with SIGKILL mid-conversation and started again: the next turn
reuses the history from the files the first process wrote; a corrupted file is a miss with an event."""

import shutil
import time

import httpx

from .test_serve_process import served  # noqa: F401  (the fixture: started servers are killed afterwards)

SYSTEM = "You are a helpful assistant."
USER1 = "Tell me about the sea. " + " ".join(["The waves roll in and out again under a grey sky."] * 5)


def chat(server, messages, **extra):
    r = httpx.post(
        f"{server.base}/v1/chat/completions",
        timeout=120,
        json={"model": "m", "messages": messages, "max_tokens": 6, "temperature": 0, **extra},
    )
    r.raise_for_status()
    body = r.json()
    return body["choices"][0]["message"]["content"], body["usage"]


def cache_stats(server):
    return httpx.get(f"{server.base}/v1/cache", timeout=30).json()


def wait_for_disk_entries(server, at_least):
    deadline = time.time() + 60  # a hang guard, not a timing assertion
    while (stats := cache_stats(server))["tiers"]["disk"]["entries"] < at_least:
        assert time.time() < deadline, stats
        time.sleep(0.1)
    return stats


def test_sigkill_then_restart_reuses_the_history_and_a_corrupted_file_is_a_miss(
    model_dirs,
    served,  # noqa: F811 (the imported fixture)
    tmp_path,
):
    model, cache_dir, damaged = model_dirs["qwen3_5"], tmp_path / "cache", tmp_path / "damaged"
    first = served(model, "--cache-dir", str(cache_dir), "--cache-disk-bytes", "1G")
    first.wait_healthy()
    turn1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER1}]
    reply, usage1 = chat(first, turn1)
    turn2 = turn1 + [{"role": "assistant", "content": reply}, {"role": "user", "content": "And then?"}]
    # the history boundary and the end of the reply, written by the writer thread
    wait_for_disk_entries(first, 2)
    first.proc.kill()  # SIGKILL: no drain, no flush, no goodbye
    first.proc.wait()
    shutil.copytree(cache_dir, damaged)
    for path in damaged.glob("*.safetensors"):
        data = bytearray(path.read_bytes())
        data[-3] ^= 0xFF  # a tensor byte: the header still reads, the MAC does not match
        path.write_bytes(bytes(data))

    second = served(model, "--cache-dir", str(cache_dir))
    second.wait_healthy()
    stats = cache_stats(second)
    assert stats["entries"] == 0 and stats["tiers"]["disk"]["entries"] >= 2
    text, usage2 = chat(second, turn2)
    cached = usage2["prompt_tokens_details"]["cached_tokens"]
    assert cached > usage1["prompt_tokens"]  # turn 1's prompt and its reply, from before the kill
    assert cache_stats(second)["tiers"]["disk"]["hits"] == 1
    exposition = httpx.get(f"{second.base}/metrics", timeout=30).text
    assert (
        "hyserve_cache_disk_hits_total 1.0" in exposition and "hyserve_cache_disk_load_seconds_count 1.0" in exposition
    )
    uncached_text, uncached = chat(second, turn2, cache_salt="elsewhere")  # no checkpoint in that namespace
    assert uncached["prompt_tokens_details"]["cached_tokens"] == 0 and uncached_text == text
    second.kill()

    third = served(model, "--cache-dir", str(damaged))
    third.wait_healthy()
    text3, usage3 = chat(third, turn2)
    assert usage3["prompt_tokens_details"]["cached_tokens"] == 0 and text3 == text
    events = httpx.get(f"{third.base}/v1/cache/events", timeout=30).json()["events"]
    assert any(e["event"] == "miss" and e["reason"] == "disk_mac_mismatch" for e in events), events
    assert not any(e["event"] == "loaded" for e in events) and cache_stats(third)["tiers"]["disk"]["hits"] == 0

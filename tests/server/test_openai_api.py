"""The OpenAI API through the official `openai` client against a real uvicorn server."""

import httpx
import pytest
import torch
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from ..conftest import FAMILIES, wait_idle

SYSTEM = "You are a helpful assistant."
USER = "What is the capital of France? Please answer the question briefly and clearly."


def client(srv) -> OpenAI:
    return OpenAI(base_url=f"{srv.base_url}/v1", api_key="unused", max_retries=0)


def hf_greedy(rt, prompt, n):
    out = rt.model.generate(
        torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=rt.tokenizer.pad_token_id
    )
    return out[0, len(prompt) :].tolist()


def _prompt_ids(srv, messages):
    return srv.service.runtime.render_chat(messages, True)


@pytest.mark.parametrize("arch", FAMILIES)
def test_chat_greedy_equals_transformers_generate(servers, arch):
    srv = servers(arch)
    c = client(srv)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}]
    ref = hf_greedy(srv.service.runtime, _prompt_ids(srv, messages), 12)
    resp = c.chat.completions.create(
        model=f"tiny-{arch}", messages=messages, max_tokens=12, temperature=0, extra_body={"return_token_ids": True}
    )
    ids = resp.choices[0].model_extra["token_ids"]
    assert ids == ref[: len(ids)] and (len(ids) == 12 or resp.choices[0].finish_reason == "stop")
    assert resp.usage.completion_tokens == len(ids)
    assert resp.usage.prompt_tokens == len(_prompt_ids(srv, messages))

    # Streaming: same tokens, same text, usage in a final chunk.
    stream = c.chat.completions.create(
        model=f"tiny-{arch}",
        messages=messages,
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"return_token_ids": True},
    )
    text, sids, usage, finish = "", [], None, None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for ch in chunk.choices:
            text += ch.delta.content or ""
            sids += (ch.model_extra or {}).get("token_ids") or []
            finish = ch.finish_reason or finish
    assert sids == ids and text == resp.choices[0].message.content
    assert finish == resp.choices[0].finish_reason
    assert usage.completion_tokens == len(ids)

    # Turn 2 reuses the history: cached_tokens is true and the output still equals transformers. The
    # history checkpoint of turn 1 is recorded in idle time (the engine ran turn 1's prompt in one pass),
    # which a client that answers within milliseconds can beat: then turn 2 recomputes it.
    wait_idle(srv.service)
    messages += [{"role": "assistant", "content": resp.choices[0].message.content}, {"role": "user", "content": "Why?"}]
    prompt2 = _prompt_ids(srv, messages)
    resp2 = c.chat.completions.create(
        model=f"tiny-{arch}", messages=messages, max_tokens=8, temperature=0, extra_body={"return_token_ids": True}
    )
    assert resp2.usage.prompt_tokens_details.cached_tokens >= len(srv.service.runtime.render_chat(messages[:2], False))
    assert (
        resp2.choices[0].model_extra["token_ids"]
        == hf_greedy(srv.service.runtime, prompt2, 8)[: resp2.usage.completion_tokens]
    )


def test_first_request_reports_zero_cached_tokens(make_service):
    from hyserve.server.run import BackgroundServer

    with BackgroundServer(make_service("qwen3_5")) as srv:
        resp = client(srv).chat.completions.create(
            model="tiny-qwen3_5", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
        assert resp.usage.prompt_tokens_details.cached_tokens == 0


def test_content_as_text_parts_equals_string(qwen35_server):
    c = client(qwen35_server)
    a = c.chat.completions.create(
        model="tiny-qwen3_5", max_tokens=6, temperature=0, messages=[{"role": "user", "content": "Tell me a story"}]
    )
    b = c.chat.completions.create(
        model="tiny-qwen3_5",
        max_tokens=6,
        temperature=0,
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "Tell me "}, {"type": "text", "text": "a story"}]}
        ],
    )
    assert a.choices[0].message.content == b.choices[0].message.content


def test_stop_strings_and_length(qwen35_server):
    c = client(qwen35_server)
    msgs = [{"role": "user", "content": USER}]
    full = c.chat.completions.create(model="tiny-qwen3_5", messages=msgs, max_tokens=20, temperature=0)
    text = full.choices[0].message.content
    assert full.choices[0].finish_reason == "length"
    stop = text[5:8]
    assert stop and text.find(stop) == 5
    cut = c.chat.completions.create(model="tiny-qwen3_5", messages=msgs, max_tokens=20, temperature=0, stop=[stop])
    assert cut.choices[0].message.content == text[:5]
    assert cut.choices[0].finish_reason == "stop"


def test_seeded_sampling_is_reproducible(qwen35_server):
    c = client(qwen35_server)
    kw = dict(
        model="tiny-qwen3_5",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=10,
        temperature=0.9,
        top_p=0.9,
        seed=11,
    )
    assert (
        c.chat.completions.create(**kw).choices[0].message.content
        == c.chat.completions.create(**kw).choices[0].message.content
    )


def test_completions_text_and_token_prompt(qwen35_server):
    c = client(qwen35_server)
    rt = qwen35_server.service.runtime
    prompt = "The quick brown fox"
    a = c.completions.create(model="tiny-qwen3_5", prompt=prompt, max_tokens=6, temperature=0)
    b = c.completions.create(model="tiny-qwen3_5", prompt=rt.encode(prompt), max_tokens=6, temperature=0)
    assert a.choices[0].text == b.choices[0].text and a.usage.completion_tokens == 6
    assert a.usage.prompt_tokens == len(rt.encode(prompt))
    parts = [
        ch.choices[0].text
        for ch in c.completions.create(model="tiny-qwen3_5", prompt=prompt, max_tokens=6, temperature=0, stream=True)
        if ch.choices
    ]
    assert "".join(parts) == a.choices[0].text


def test_models_health_metrics_cache_admin(qwen35_server):
    c = client(qwen35_server)
    c.chat.completions.create(model="tiny-qwen3_5", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert [m.id for m in c.models.list().data] == ["tiny-qwen3_5"]
    base = qwen35_server.base_url
    health = httpx.get(f"{base}/health").json()
    assert health["status"] == "ok" and health["idle"] in (True, False)
    assert health["kernels"]["capture"] == "on", health["kernels"]  # the load-time check passed
    text = httpx.get(f"{base}/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in (
        "hyserve_requests",
        "hyserve_prompt_tokens",
        "hyserve_generation_tokens",
        "hyserve_time_to_first_token_seconds",
        "hyserve_inter_token_latency_seconds",
        "hyserve_cache_hits",
        "hyserve_cache_bytes",
        "hyserve_cache_state_bytes",
        "hyserve_cache_kv_bytes",
        "hyserve_cache_snapshot_seconds",
        "hyserve_runtime_lock_hold_seconds",
        "hyserve_cache_snapshots_per_request",
        "hyserve_decode_batch_size",
        "hyserve_decode_batch_gathers",
        "hyserve_spec_proposed_tokens",
    ):
        assert name in families, name
    assert "hyserve_live_state_bytes" in families
    active = {s.labels["kernel"]: s.value for s in families["hyserve_kernel_active"].samples}
    assert active["chunk_gated_delta_rule"] == 1 and set(active) == set(health["kernels"])
    rss = families["process_resident_memory_bytes"].samples[0].value  # the process collector (Linux)
    assert rss > 10 << 20
    gen = sum(s.value for s in families["hyserve_generation_tokens"].samples if s.name.endswith("_total"))
    assert gen >= 3
    stats = httpx.get(f"{base}/v1/cache").json()
    assert stats["entries"] >= 1 and stats["bytes"] > 0
    assert stats["bytes"] == stats["state_bytes"] + stats["kv_bytes"] and stats["kv_sharing"] is True
    gauges = {
        name: families[name].samples[0].value
        for name in ("hyserve_cache_bytes", "hyserve_cache_state_bytes", "hyserve_cache_kv_bytes")
    }
    assert gauges["hyserve_cache_bytes"] == gauges["hyserve_cache_state_bytes"] + gauges["hyserve_cache_kv_bytes"] > 0
    events = httpx.get(f"{base}/v1/cache/events").json()["events"]
    assert {"recorded", "miss"} <= {e["event"] for e in events}
    cleared = httpx.delete(f"{base}/v1/cache").json()
    assert cleared["entries"] == 0 and cleared["bytes"] == 0

"""`DELETE /v1/cache` leaves nothing of the caller's behind (issue 36): not the checkpoints its running requests
hold, not what they record after the clear, not its files on disk; a replay then restores nothing. Other
tenants keep theirs."""

import asyncio
import json
import time

import httpx

from hyserve.server.run import BackgroundServer

from ..conftest import QWEN35_TEMPLATE, wait_idle

MODEL = "tpl"
KA, KB = "key-a", "key-b"
REPLY = (
    "Sundials came first, then water clocks and candles; mechanical clocks with escapements followed in "
    "medieval Europe, pendulums in the seventeenth century, quartz in the twentieth, and atomic clocks last."
)
HISTORY = [
    {"role": "system", "content": "You are a patient assistant who answers in detail."},
    {"role": "user", "content": "Tell me about the history of clocks, from sundials to atomic ones."},
]


def auth(key):
    return {"Authorization": f"Bearer {key}"}


def chat(base, key, messages, seed=None):
    r = httpx.post(
        f"{base}/v1/chat/completions",
        headers=auth(key),
        timeout=120,
        json={"model": MODEL, "messages": messages, "max_tokens": 64, "temperature": 0, "seed": seed},
    )
    assert r.status_code == 200, r.text
    return r.json()


def cached(reply) -> int:
    return reply["usage"]["prompt_tokens_details"]["cached_tokens"]


def cache(base, key, method="GET"):
    r = httpx.request(method, f"{base}/v1/cache", headers=auth(key), timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


async def stream(client, base, seed: int, started: asyncio.Event, count: list, n: int) -> str:
    """A streamed turn of HISTORY for tenant A (REPLY, forced by `seed`); `started` once `n` streams have
    their first token."""
    body = {"model": MODEL, "messages": HISTORY, "max_tokens": 64, "temperature": 0, "seed": seed, "stream": True}
    text = ""
    async with client.stream("POST", f"{base}/v1/chat/completions", json=body, headers=auth(KA)) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            delta = json.loads(line[6:])["choices"][0]["delta"]
            piece = delta.get("reasoning_content") or delta.get("content") or ""
            if piece and not text:
                count[0] += 1
                if count[0] == n:
                    started.set()
            text += piece
    return text


def test_a_clear_under_load_leaves_nothing_of_the_tenant(make_service, template_model_dirs, force, tmp_path):
    svc = make_service(
        "qwen3_5",
        model_dir=template_model_dirs("qwen3_5", QWEN35_TEMPLATE),
        served_model_name=MODEL,
        api_keys=(KA, KB),
        cache_dir=tmp_path / "disk",
        max_running=4,
    )
    eng, seed = svc.engine, force(svc.runtime, REPLY)
    with BackgroundServer(svc) as srv:
        base = srv.base_url
        chat(base, KB, HISTORY, seed)  # tenant B's checkpoints, which A's clear must leave alone
        reply = chat(base, KA, HISTORY, seed)["choices"][0]["message"]  # A's: restored (pinned) below
        next_turn = HISTORY + [reply, {"role": "user", "content": "And then?"}]
        wait_idle(svc)
        b_before = cache(base, KB)
        assert b_before["entries"] > 0 and cache(base, KA)["entries"] > 0

        inner = eng.step

        def slow_step():  # every step a little slower: the streams are surely still running at the clear
            inner()
            time.sleep(0.05)

        eng.step = slow_step
        try:

            async def load():
                started, count, n = asyncio.Event(), [0], 3
                async with httpx.AsyncClient(timeout=120) as client:
                    streams = [asyncio.create_task(stream(client, base, seed, started, count, n)) for _ in range(n)]
                    await asyncio.wait_for(started.wait(), 60)
                    r = await client.delete(f"{base}/v1/cache", headers=auth(KA))
                    assert r.status_code == 200, r.text
                    assert not all(s.done() for s in streams)  # in flight while clearing
                    return r.json(), await asyncio.gather(*streams)

            cleared, replies = asyncio.run(load())
        finally:
            eng.step = inner
        assert cleared["entries"] == 0 and cleared["tiers"]["disk"]["entries"] == 0
        wait_idle(svc)
        svc.cache.disk.flush()
        after = cache(base, KA)
        assert after["entries"] == 0 and after["tiers"]["disk"]["entries"] == 0, after
        events = httpx.get(f"{base}/v1/cache/events?limit=2000", headers=auth(KA), timeout=30).json()["events"]
        since = max(i for i, e in enumerate(events) if e["event"] == "cleared")
        assert not [e for e in events[since:] if e["event"] in ("recorded", "spilled", "loaded")], events[since:]

        # the replay of the turn the clear cut into, and its next turn: nothing restored
        assert all(replies)
        assert cached(chat(base, KA, next_turn)) == 0
        b_after = cache(base, KB)
        assert (b_after["entries"], b_after["tiers"]["disk"]["entries"]) == (
            b_before["entries"],
            b_before["tiers"]["disk"]["entries"],
        )
        assert cached(chat(base, KB, HISTORY)) > 0
        assert cached(chat(base, KB, next_turn)) > 0


def test_a_request_that_arrived_before_the_clear_records_nothing(make_service):
    """Its prompt was still being rendered when the clear came: it reaches the engine after it, and is stale."""
    from hyserve.engine import GenerationRequest

    svc = make_service("qwen3_5")
    eng, prompt = svc.engine, svc.runtime.encode("Tell me about the history of clocks, please.")

    def ask():
        return eng.generate(GenerationRequest(prompt=list(prompt), max_tokens=3, keep_final=True, cache_salt="t:"))

    early = GenerationRequest(prompt=list(prompt), max_tokens=3, keep_final=True, cache_salt="t:")
    assert eng.clear_cache("t") == 0
    eng.generate(early)
    assert svc.cache.stats("t")["entries"] == 0
    assert ask().cached_tokens == 0 and svc.cache.stats("t")["entries"] > 0  # a request after the clear records


def test_jobs_of_the_tenant_are_cancelled_or_record_nothing(make_service):
    """One job is being built (started and a piece in) when the clear comes, another is queued: neither leaves
    a checkpoint. Another tenant's queued job still runs."""
    from hyserve.cache.policy import Boundary
    from hyserve.engine.run import Job

    svc = make_service("qwen3_5")
    eng, rt = svc.engine, svc.runtime

    def job(text, salt, rid):
        tokens = rt.encode(text)
        return Job(list(tokens), [Boundary(len(tokens), "history")], salt, rid)

    with rt.lock:  # the engine waits for the lock: what it would do between two pieces of the job
        eng.scheduler.add_background(job("The history of clocks, from sundials to atomic ones.", "t:", "running"))
        assert eng.background._select(lambda j: j.request_id == "running")  # started, as the engine starts it
        eng.background._piece(4)
        assert eng.background.active is not None and eng.background.active.request_id == "running"
        eng.scheduler.add_background(job("Tell me about the history of maps.", "other:", "kept"))
        eng.scheduler.add_background(job("Tell me about the history of ships.", "t:", "queued"))
        eng.clear_cache("t")
        assert eng.background.active is None
    wait_idle(svc)
    assert svc.cache.stats("t")["entries"] == 0 and svc.cache.stats("other")["entries"] == 1
    declined = {
        e["request_id"]
        for e in svc.cache.telemetry.events(None, 100)
        if e["event"] == "declined" and e["reason"] == "cleared"
    }
    assert declined == {"running", "queued"}


def test_the_tokenizer_forgets_the_tenants_texts():
    """The tokenizer's reuse of earlier prompt texts keeps them (`prompt_tokens`): a clear drops the tenant's."""
    from hyserve.cache.namespace import make_salt
    from hyserve.prompt.tokens import PrefixEncoder
    from hyserve.testing.tiny import train_tokenizer

    tok = train_tokenizer()
    encoder = PrefixEncoder(tok)
    msgs = [{"role": "system", "content": "sys"}, {"role": "user", "content": "a private document " * 50}]
    first = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    second = tok.apply_chat_template(
        msgs + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    for salt in (make_salt("ta", None), make_salt("ta", "project"), make_salt("tb", None)):
        encoder.encode(first, salt=salt)
    encoder.forget("ta")
    encoder.encode(second, salt=make_salt("ta", "project"))
    assert encoder.reused_tokens == 0  # nothing of ta's left to reuse
    encoder.encode(second, salt=make_salt("tb", None))
    assert encoder.reused_tokens > 0  # tb's text stays

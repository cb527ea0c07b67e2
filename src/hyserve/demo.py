"""`hyserve demo`: build a tiny model if needed, serve it, chat two turns with the openai client."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from .server.run import BackgroundServer
from .service import ServiceConfig, build_service
from .testing.tiny import make_tiny_model


def _default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "hyserve"


def run_demo(arch: str = "qwen3_5", cache_dir: str | None = None) -> int:
    from openai import OpenAI

    model_dir = Path(cache_dir or _default_cache_dir()) / f"tiny-{arch}"
    if not (model_dir / "config.json").exists():
        print(f"building a tiny random-init {arch} model in {model_dir} ...")
        make_tiny_model(model_dir, arch, force=True)  # its own cache folder: a half-built one is redone
    service = build_service(ServiceConfig(model_dir=model_dir, served_model_name=f"tiny-{arch}", cache_bytes=256 << 20))
    print("NOTE: the weights are random, so the replies are gibberish; the point is the plumbing and the cache.")
    with BackgroundServer(service) as srv:
        client = OpenAI(base_url=f"{srv.base_url}/v1", api_key="unused")
        messages = [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is the capital of France?"},
        ]
        cached = 0
        for turn in (1, 2):
            resp = client.chat.completions.create(model=f"tiny-{arch}", messages=messages, max_tokens=24, temperature=0)
            reply = resp.choices[0].message.content
            u = resp.usage
            print(f"turn {turn} reply: {reply!r}")
            print(
                f"turn {turn} usage: prompt_tokens={u.prompt_tokens} completion_tokens={u.completion_tokens} "
                f"cached_tokens={u.prompt_tokens_details.cached_tokens}"
            )
            if turn == 2:
                cached = u.prompt_tokens_details.cached_tokens
                history = len(service.runtime.render_chat(messages[:-1], False))
                print(f"turn 2 history_tokens={history} (the conversation before the new message)")
            messages += [
                {"role": "assistant", "content": reply},
                {"role": "user", "content": "Tell me a story about a robot."},
            ]
            if turn == 1:  # a user reads the reply first: the server records the history's checkpoint meanwhile
                _wait_idle(srv.base_url)
        stats = client.get("/cache", cast_to=object)
        print(f"prefix cache: {stats}")
    service.engine.stop()
    if not cached:
        print("hyserve demo: turn 2 reused no cached tokens: the prefix cache is not working", file=sys.stderr)
        return 1
    return 0


def _wait_idle(base_url: str, limit: float = 10.0) -> None:
    """Until /health says the engine has no work left, idle-time checkpoints included (at most `limit` s)."""
    import time

    import httpx

    deadline = time.monotonic() + limit
    while not httpx.get(f"{base_url}/health").json().get("idle", True) and time.monotonic() < deadline:
        time.sleep(0.01)

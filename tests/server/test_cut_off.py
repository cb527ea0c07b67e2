"""A reply cut at the `--graceful-shutdown` limit says so (issue 36): each route's stream ends with an explicit
error in its own format, which the real openai and anthropic clients raise or report, never a clean end that
looks like a complete reply; a whole reply cancelled before its response started gets a 503 in its route's
shape."""

import contextlib
import signal
import threading
import time

import anthropic
import httpx
import openai
import pytest

from hyserve.server.run import CUT_OFF, draining_server, free_port

MODEL = "tiny-qwen3_5"
ASK = [{"role": "user", "content": "Tell me a long story about a robot."}]


@contextlib.contextmanager
def stopping_server(make_service, budget: float = 0.5, engine_cuts: bool = True):
    """A draining server on a thread (as `hyserve serve` runs it), whose engine is slowed down so that a long
    reply cannot finish within `budget`; yields (base URL, stop()), stop() acting as SIGTERM does.
    `engine_cuts=False`: the engine fails nothing at the limit, uvicorn cancels the stream (the fallback)."""
    svc = make_service("qwen3_5")
    eng, inner = svc.engine, svc.engine.step
    if not engine_cuts:
        eng.cut_off = lambda message: 0

    def slow_step():
        inner()
        time.sleep(0.05)

    eng.step = slow_step
    port = free_port()
    server = draining_server(svc, "127.0.0.1", port, budget)
    thread = threading.Thread(target=server.run, name="test-draining-server", daemon=True)
    thread.start()
    deadline = time.time() + 60
    while not server.started:
        assert time.time() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}", lambda: server.handle_exit(signal.SIGTERM, None)
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        eng.step = inner
    assert not thread.is_alive()


LONG = dict(max_tokens=400, temperature=0)


@pytest.mark.parametrize("engine_cuts", [True, False], ids=["engine", "cancelled"])
def test_a_chat_stream_cut_at_shutdown_raises_in_the_openai_client(make_service, engine_cuts):
    with stopping_server(make_service, engine_cuts=engine_cuts) as (base, stop):
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
        stream = client.chat.completions.create(
            model=MODEL, messages=ASK, stream=True, extra_body={"min_tokens": 400}, **LONG
        )
        chunks = []
        with pytest.raises(openai.APIError) as err:
            for chunk in stream:
                chunks.append(chunk)
                if len(chunks) == 2:
                    stop()
        assert err.value.message == CUT_OFF and err.value.body["code"] == "shutting_down"
        assert all(c.choices[0].finish_reason is None for c in chunks if c.choices)


def test_a_responses_stream_cut_at_shutdown_ends_with_response_failed(make_service):
    with stopping_server(make_service) as (base, stop):
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
        events = []
        for event in client.responses.create(
            model=MODEL,
            input="Tell me a long story about a robot.",
            stream=True,
            max_output_tokens=400,
            temperature=0,
            extra_body={"min_tokens": 400},
        ):
            events.append(event)
            if event.type == "response.output_text.delta" and len(events) == 1 + [e.type for e in events].index(
                "response.output_text.delta"
            ):
                stop()
        assert events[-1].type == "response.failed" and events[-1].response.status == "failed", events[-3:]
        assert events[-1].response.error.message == CUT_OFF and events[-1].response.error.code == "server_error"
        assert events[-1].sequence_number == events[-2].sequence_number + 1
        assert not [e for e in events if e.type in ("error", "response.completed", "response.incomplete")]


def test_a_messages_stream_cut_at_shutdown_raises_in_the_anthropic_client(make_service):
    with stopping_server(make_service) as (base, stop):
        client = anthropic.Anthropic(base_url=base, api_key="x", max_retries=0)
        seen = []
        with pytest.raises(anthropic.APIStatusError) as err:
            with client.messages.stream(
                model=MODEL, messages=ASK, max_tokens=400, extra_body={"min_tokens": 400, "temperature": 0}
            ) as stream:
                for event in stream:
                    seen.append(event.type)
                    if event.type == "content_block_delta" and seen.count("content_block_delta") == 2:
                        stop()
        assert err.value.body["error"] == {"type": "overloaded_error", "message": CUT_OFF}
        assert "message_stop" not in seen


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
def test_a_whole_reply_cancelled_at_shutdown_is_a_503_in_its_routes_shape(make_service, path):
    """A reply that has not started its response when uvicorn cancels it (the engine cuts nothing here) gets
    the 503 a draining request gets, in its route's shape: Anthropic's on /v1/messages."""
    result = {}
    with stopping_server(make_service, engine_cuts=False) as (base, stop):
        body = {"model": MODEL, "messages": ASK, "min_tokens": 400, **LONG}
        sender = threading.Thread(target=lambda: result.update(resp=httpx.post(f"{base}{path}", json=body, timeout=60)))
        sender.start()
        deadline = time.time() + 30
        while httpx.get(f"{base}/health", timeout=10).json()["idle"]:  # until the engine has the request
            assert time.time() < deadline and sender.is_alive(), "the request never reached the engine"
            time.sleep(0.02)
        stop()
        sender.join(timeout=60)
    resp = result["resp"]
    assert resp.status_code == 503, resp.text
    if path == "/v1/messages":
        error = {"type": "overloaded_error", "message": "server is shutting down"}
        assert resp.json() == {"type": "error", "error": error}
    else:
        assert resp.json()["error"] == {
            "message": "server is shutting down",
            "type": "server_error",
            "param": None,
            "code": "shutting_down",
        }

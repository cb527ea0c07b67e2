"""`hyserve serve` as users run it, in a process of its own: its log (text and JSON lines: loading stages,
an access line per request, the periodic engine line, prefill chunks at debug), its stop on Ctrl-C (one:
drain and exit 0 quietly; two: exit at once with 130), and its refusal of a busy port before loading."""

import json
import queue
import re
import signal
import socket
import subprocess
import threading
import time

import httpx
import pytest
from openai import OpenAI

from hyserve.server.run import free_port

from .conftest import serve_command, wait_healthy

ACCESS = re.compile(r'(?P<client>\S+) - "(?P<method>[A-Z]+) (?P<path>\S+) HTTP/[\d.]+" (?P<status>\d+)(?P<kv>.*)')


class Served:
    """A `hyserve serve` process whose stderr is read line by line as it comes."""

    def __init__(self, model_dir, *flags, port=None):
        self.port = port or free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            serve_command(model_dir, self.port, *flags),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: list[str] = []
        self._new: queue.Queue = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.proc.stderr:
            self._new.put(line.rstrip("\n"))
        self._new.put(None)

    def wait_for(self, pred, what: str, timeout: float = 120) -> str:
        """The first line (seen before or arriving now) that `pred` accepts; fails on exit or after `timeout`
        (a hang guard, not a timing assertion)."""
        for line in self.lines:
            if pred(line):
                return line
        deadline = time.time() + timeout
        while time.time() < deadline:
            try:
                line = self._new.get(timeout=0.5)
            except queue.Empty:
                continue
            if line is None:
                raise AssertionError(f"server exited ({self.proc.wait()}) before {what}:\n" + "\n".join(self.lines))
            self.lines.append(line)
            if pred(line):
                return line
        raise AssertionError(f"no {what} within {timeout} s:\n" + "\n".join(self.lines))

    def wait_healthy(self):
        wait_healthy(self.base, self.proc, lambda: "\n".join(self.lines))

    def finish(self, timeout: float = 60) -> int:
        """Exit status, once stderr is read to its end."""
        rc = self.proc.wait(timeout=timeout)
        self._reader.join(timeout=10)
        while (line := self._new.get_nowait() if not self._new.empty() else None) is not None:
            self.lines.append(line)
        return rc

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def served():
    started = []

    def start(*args, **kw):
        started.append(Served(*args, **kw))
        return started[-1]

    yield start
    for s in started:
        s.kill()


def hold_request_in_flight(port: int) -> socket.socket:
    """A request the server has admitted (past its guards, "100 Continue" sent) and waits on for its body."""
    body = json.dumps({"model": "m", "prompt": "hello", "max_tokens": 3, "temperature": 0}).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=60)
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
        b"Content-Type: application/json\r\nExpect: 100-continue\r\n"
        b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n"
    )
    assert sock.recv(4096).startswith(b"HTTP/1.1 100")
    return sock


def test_json_log_has_loading_access_engine_and_prefill_lines(model_dirs, served):
    s = served(
        model_dirs["qwen3_5"],
        "--log-format",
        "json",
        "--log-level",
        "debug",
        "--prefill-chunk",
        "16",
        "--log-stats-interval",
        "0.2",
    )
    s.wait_healthy()
    client = OpenAI(base_url=f"{s.base}/v1", api_key="unused")
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is the capital of France? Answer in one word."},
    ]
    reply = client.chat.completions.create(model="m", messages=messages, max_tokens=8, temperature=0)
    stream = client.chat.completions.create(
        model="m", messages=messages, max_tokens=8, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    usage = [c.usage for c in stream if c.usage][0]
    assert httpx.post(f"{s.base}/v1/completions", json={"model": "nope", "prompt": "x"}).status_code == 404

    def record(line):
        return json.loads(line)  # every line is one JSON object

    def access(rid):
        return lambda l: record(l)["logger"] == "hyserve.access" and record(l).get("id") == rid

    done = record(s.wait_for(access(reply.id), "the access line of the chat request"))
    assert done["method"] == "POST" and done["path"] == "/v1/chat/completions" and done["status"] == 200
    assert done["prompt_tokens"] == reply.usage.prompt_tokens and done["cached_tokens"] == 0
    assert (
        done["generated_tokens"] == reply.usage.completion_tokens and done["finish"] == reply.choices[0].finish_reason
    )
    assert 0 <= done["ttft_s"] <= done["duration_s"] and done["level"] == "INFO"
    assert ACCESS.match(done["message"]) and f"id={reply.id}" in done["message"]
    streamed = record(
        s.wait_for(
            lambda l: (
                record(l)["logger"] == "hyserve.access"
                and record(l).get("id") not in (None, reply.id)
                and record(l)["path"] == "/v1/chat/completions"
            ),
            "the stream's line",
        )
    )
    assert streamed["cached_tokens"] == usage.prompt_tokens_details.cached_tokens
    assert streamed["generated_tokens"] == usage.completion_tokens
    refused = record(s.wait_for(lambda l: record(l).get("path") == "/v1/completions", "the 404's line"))
    assert refused["status"] == 404 and refused.get("id") is None

    def engine(l):
        return record(l)["logger"] == "hyserve.stats"

    decoding = record(s.wait_for(lambda l: engine(l) and record(l)["generation_tok_s"] > 0, "an engine line"))
    assert decoding["running"] >= 0 and decoding["waiting"] >= 0 and decoding["cache_budget_bytes"] > 0
    assert "Avg generation throughput" in decoding["message"]
    # an interval in which a prefill finished has a hit rate (the others have none: null)
    prefilled = record(s.wait_for(lambda l: engine(l) and record(l)["cache_hit_rate"] is not None, "a hit rate"))
    assert 0 <= prefilled["cache_hit_rate"] <= 1 and prefilled["prompt_tok_s"] > 0

    chunks = [record(l)["message"] for l in s.lines if "prefill chatcmpl" in record(l)["message"]]
    assert len(chunks) >= 3 and all(record(l)["level"] == "DEBUG" for l in s.lines if "prefill chatcmpl" in l)
    loading = [record(l)["message"] for l in s.lines if record(l)["logger"] == "hyserve.runtime"]
    assert any(m.startswith("loading ") for m in loading) and any("weights loaded" in m for m in loading)
    assert any(record(l)["logger"] == "hyserve.access" and record(l)["path"] == "/health" for l in s.lines)

    s.proc.send_signal(signal.SIGINT)
    assert s.finish() == 0  # an idle Ctrl-C: a clean stop
    assert all(record(l) for l in s.lines) and not any("Traceback" in l for l in s.lines)
    assert any("no request in flight, stopping" in record(l)["message"] for l in s.lines)


def test_text_access_line_and_a_second_ctrl_c_exits_at_once(model_dirs, served):
    s = served(model_dirs["qwen3_5"], "--graceful-shutdown", "600")
    s.wait_healthy()
    r = httpx.post(
        f"{s.base}/v1/completions", json={"model": "m", "prompt": "hello", "max_tokens": 4, "temperature": 0}
    )
    assert r.status_code == 200
    line = s.wait_for(lambda l: "hyserve.access" in l and "/v1/completions" in l, "the access line")
    m = ACCESS.search(line)
    assert m and m["status"] == "200" and m["method"] == "POST"
    kv = dict(pair.split("=", 1) for pair in m["kv"].split())
    assert kv["id"] == r.headers["x-request-id"] == r.json()["id"]
    assert int(kv["prompt_tokens"]) == r.json()["usage"]["prompt_tokens"]
    assert int(kv["generated_tokens"]) == r.json()["usage"]["completion_tokens"]
    assert kv["finish"] in ("stop", "length") and 0 <= float(kv["ttft_s"]) <= float(kv["duration_s"])

    held = hold_request_in_flight(s.port)
    s.proc.send_signal(signal.SIGINT)
    s.wait_for(lambda l: "SIGINT: finishing 1 request(s) in flight" in l and "600 s" in l, "the drain message")
    s.proc.send_signal(signal.SIGINT)  # would otherwise wait up to 600 s for the held request
    assert s.finish() == 130
    held.close()
    assert any("SIGINT again: exiting now, 1 request(s) cut off" in l for l in s.lines)
    assert not any("Traceback" in l or "KeyboardInterrupt" in l for l in s.lines), "\n".join(s.lines)


def test_a_busy_port_stops_start_up_before_the_model_loads(model_dirs, served):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        s = served(model_dirs["qwen3_5"], port=port)
        assert s.finish() == 2
    out = "\n".join(s.lines)
    assert f"port {port} on 127.0.0.1 is already in use" in out
    assert "loading" not in out and "Traceback" not in out

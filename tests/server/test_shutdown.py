"""SIGTERM on a real `hyserve serve` process: while a request is still in flight the server keeps
listening, a new request gets a 503 with an OpenAI error body, the running one finishes, then it exits."""

import contextlib
import json
import signal
import socket
import subprocess
import time

import httpx

from hyserve.server.run import free_port

from .conftest import serve_command, wait_healthy


def _read_response(sock) -> tuple[int, bytes]:
    """Status and body of one HTTP/1.1 response with Connection: close."""
    reply = b""
    while chunk := sock.recv(65536):
        reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


@contextlib.contextmanager
def serving(model_dir):
    """A `hyserve serve` process on a free port, once /health answers 200: yields (process, base URL)."""
    port = free_port()
    proc = subprocess.Popen(
        serve_command(model_dir, port, "--graceful-shutdown", "60"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, proc, lambda: proc.stderr.read() if proc.poll() is not None else "")
        yield proc, base
    finally:
        if proc.poll() is None:
            proc.kill()


def test_sigterm_lets_a_running_stream_finish(model_dirs):
    with serving(model_dirs["qwen3_5"]) as (proc, base):
        body = {
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 150,
            "temperature": 0,
            "stream": True,
        }
        lines, signalled = [], False
        with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                lines.append(line)
                if not signalled and '"content"' in line:
                    proc.send_signal(signal.SIGTERM)
                    signalled = True
        assert lines[-1] == "data: [DONE]" or "data: [DONE]" in lines
        assert any('"finish_reason":"length"' in l.replace(" ", "") for l in lines)
        assert proc.wait(timeout=60) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal after draining


def test_a_request_arriving_while_draining_gets_503(model_dirs):
    with serving(model_dirs["qwen3_5"]) as (proc, base):
        # A request in flight: its headers are in and the app waits for its body. "100 Continue" proves the
        # server has passed it its guards and is reading it.
        body = json.dumps({"model": "m", "prompt": "hello", "max_tokens": 3, "temperature": 0}).encode()
        running = socket.create_connection(("127.0.0.1", int(base.rsplit(":", 1)[1])), timeout=60)
        running.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
            b"Content-Type: application/json\r\nExpect: 100-continue\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n"
        )
        assert running.recv(4096).startswith(b"HTTP/1.1 100")

        proc.send_signal(signal.SIGTERM)
        while httpx.get(f"{base}/health").status_code != 503:  # draining: the process still listens
            assert proc.poll() is None
            time.sleep(0.05)
        r = httpx.post(f"{base}/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 503, r.text
        assert r.json()["error"] == {
            "message": "server is shutting down",
            "type": "server_error",
            "param": None,
            "code": "shutting_down",
        }
        assert r.headers["connection"] == "close"

        running.sendall(body)  # the request in flight finishes normally
        status, reply = _read_response(running)
        running.close()
        assert status == 200, reply
        assert json.loads(reply)["usage"]["completion_tokens"] == 3
        assert proc.wait(timeout=60) in (0, -signal.SIGTERM)

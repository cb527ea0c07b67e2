"""The watchdog (issue 19): a step that keeps raising or hangs fails the requests it involves, `/health` says
degraded (503) while the engine makes no progress, and the server then serves the next request exactly."""

import threading
import time

import httpx

from hyserve.server.run import BackgroundServer

BODY = {
    "model": "tiny-qwen3_5",
    "messages": [{"role": "user", "content": "Tell me a story about a robot."}],
    "max_tokens": 8,
    "temperature": 0,
}


def _post(base, out):
    out.append(httpx.post(f"{base}/v1/chat/completions", json=BODY, timeout=60))


def _until(pred, what, deadline=30.0):
    end = time.monotonic() + deadline
    while not pred():
        assert time.monotonic() < end, f"never saw {what}"
        time.sleep(0.02)


def _text(resp):
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["message"]["content"]


def test_a_step_that_keeps_raising_fails_its_requests_and_the_engine_recovers(make_service):
    svc = make_service("qwen3_5")
    eng = svc.engine
    with BackgroundServer(svc) as srv:
        solo = _text(httpx.post(f"{srv.base_url}/v1/chat/completions", json=BODY, timeout=60))
        inner, faults = eng.step, [4]  # the next 4 steps that have work raise, after doing it

        def faulty():
            inner()
            if faults[0] > 0 and (eng.scheduler.running or eng.scheduler.waiting):
                faults[0] -= 1
                time.sleep(0.2)  # long enough for /health to be asked while failing
                raise RuntimeError("injected step fault")

        eng.step = faulty
        try:
            out, health = [], []
            t = threading.Thread(target=_post, args=(srv.base_url, out))
            t.start()
            while t.is_alive():
                health.append(httpx.get(f"{srv.base_url}/health"))
                time.sleep(0.02)
            t.join()
            assert out[0].status_code == 500 and "failed 3 times in a row" in out[0].json()["error"]["message"]
            degraded = [h for h in health if h.status_code == 503]
            assert degraded and degraded[0].json()["status"] == "degraded"
            assert "failed" in degraded[0].json()["reason"]
            # the fourth fault hits the next request's first step: it still finishes, with its solo tokens
            assert _text(httpx.post(f"{srv.base_url}/v1/chat/completions", json=BODY, timeout=60)) == solo
            assert faults == [0]
        finally:
            del eng.step
        h = httpx.get(f"{srv.base_url}/health")
        assert h.status_code == 200 and h.json()["status"] == "ok"
        assert not eng.scheduler.running and svc.metrics.registry.get_sample_value("hyserve_requests_running") == 0


def test_a_hung_step_fails_its_requests_health_says_degraded_and_the_server_recovers(make_service):
    svc = make_service("qwen3_5", stall_timeout=2.0)
    eng = svc.engine
    with BackgroundServer(svc) as srv:
        solo = _text(httpx.post(f"{srv.base_url}/v1/chat/completions", json=BODY, timeout=60))
        inner, gate = eng.step, threading.Event()

        def hung():
            if eng.scheduler.busy and not gate.is_set():
                inner()  # the request is admitted and running when the step hangs
                gate.wait(60)
            else:
                inner()

        eng.step = hung
        try:
            out = []
            t = threading.Thread(target=_post, args=(srv.base_url, out))
            t.start()
            _until(lambda: httpx.get(f"{srv.base_url}/health").status_code == 503, "/health degraded")
            h = httpx.get(f"{srv.base_url}/health").json()
            assert h["status"] == "degraded" and "has run for" in h["reason"]
            t.join(30)  # the watchdog answers the stuck request while its step still hangs
            assert not t.is_alive() and not gate.is_set()
            assert out[0].status_code == 500 and "no progress" in out[0].json()["error"]["message"]
            late = []  # a request arriving behind the hung step is answered too
            _post(srv.base_url, late)
            assert late[0].status_code == 500
            gate.set()  # the step returns
            _until(lambda: httpx.get(f"{srv.base_url}/health").status_code == 200, "/health ok again")
            assert _text(httpx.post(f"{srv.base_url}/v1/chat/completions", json=BODY, timeout=60)) == solo
        finally:
            gate.set()
            del eng.step
        assert not eng.scheduler.running and svc.metrics.registry.get_sample_value("hyserve_requests_running") == 0

"""Guards with API keys: each tenant sees and clears only its own cache, the admin key all of it; a
malformed Authorization is a 401; the API document is behind the key and says what the server sends;
a chunked body over the limit is a 413."""

import json
import socket

import httpx
import pytest

from hyserve.server.guards import key_tenant
from hyserve.server.run import BackgroundServer

from ..conftest import wait_idle

MODEL = "tiny-qwen3_5"
KA, KB, ADMIN = "key-a", "key-b", "key-admin"


@pytest.fixture(scope="module")
def keyed(make_service):
    svc = make_service("qwen3_5", api_keys=(KA, KB), admin_api_key=ADMIN, max_body_bytes=4000)
    with BackgroundServer(svc) as srv:
        yield srv


def auth(key):
    return {"Authorization": f"Bearer {key}"}


def two_turns(srv, key, topic):
    """A two-turn chat; returns the second turn's cached tokens and both request ids."""
    url = f"{srv.base_url}/v1/chat/completions"
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": f"Tell me about {topic}."}]
    first = httpx.post(
        url, json={"model": MODEL, "messages": msgs, "max_tokens": 4, "temperature": 0}, headers=auth(key), timeout=60
    ).json()
    wait_idle(srv.service)
    msgs += [first["choices"][0]["message"], {"role": "user", "content": "More."}]
    second = httpx.post(
        url, json={"model": MODEL, "messages": msgs, "max_tokens": 4, "temperature": 0}, headers=auth(key), timeout=60
    ).json()
    wait_idle(srv.service)
    return second["usage"]["prompt_tokens_details"]["cached_tokens"], {first["id"], second["id"]}, msgs


def cache(srv, key, method="GET", path="/v1/cache"):
    r = httpx.request(method, f"{srv.base_url}{path}", headers=auth(key), timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_tenant_clears_and_reads_only_its_own_cache(keyed):
    srv = keyed
    cache(srv, ADMIN, "DELETE")
    cached_a, ids_a, _ = two_turns(srv, KA, "robots who paint")
    cached_b, ids_b, msgs_b = two_turns(srv, KB, "a lighthouse keeper")
    assert cached_a > 0 and cached_b > 0
    b_before = cache(srv, KB)
    assert b_before["entries"] > 0 and b_before["hits"] >= 1
    everything = cache(srv, ADMIN)
    assert everything["entries"] == cache(srv, KA)["entries"] + b_before["entries"]

    # A reads its own events only: none of B's requests, every one stamped with A's tenant
    events_a = cache(srv, KA, path="/v1/cache/events?limit=2000")["events"]
    assert events_a and {e["tenant"] for e in events_a} == {key_tenant(KA)}
    assert {e.get("request_id") for e in events_a} & ids_b == set()
    assert {e.get("request_id") for e in events_a} & ids_a == ids_a
    events_all = cache(srv, ADMIN, path="/v1/cache/events?limit=2000")["events"]
    assert {e.get("request_id") for e in events_all} >= ids_a | ids_b

    # A's DELETE leaves B's entries; B's next turn still starts from its cached history
    cleared = cache(srv, KA, "DELETE")
    assert cleared["cleared"] > 0 and cleared["entries"] == 0
    assert cache(srv, KB)["entries"] == b_before["entries"]
    assert cache(srv, ADMIN)["entries"] == b_before["entries"]
    r = httpx.post(
        f"{srv.base_url}/v1/chat/completions",
        headers=auth(KB),
        timeout=60,
        json={
            "model": MODEL,
            "messages": msgs_b + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "Again."}],
            "max_tokens": 2,
            "temperature": 0,
        },
    )
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    wait_idle(srv.service)
    # B does not see A's clear; the admin's clear empties every tenant
    assert not [e for e in cache(srv, KB, path="/v1/cache/events?limit=2000")["events"] if e["event"] == "cleared"]
    assert cache(srv, ADMIN, "DELETE")["entries"] == 0
    assert cache(srv, KB)["entries"] == 0


def test_without_keys_the_cache_routes_act_on_everything(qwen35_server):
    srv = qwen35_server
    httpx.post(
        f"{srv.base_url}/v1/completions", json={"model": MODEL, "prompt": "hello there", "max_tokens": 2}, timeout=60
    )
    wait_idle(srv.service)
    events = httpx.get(f"{srv.base_url}/v1/cache/events").json()["events"]
    assert any(e["event"] == "recorded" for e in events)
    assert httpx.get(f"{srv.base_url}/v1/cache").json()["entries"] > 0
    assert httpx.delete(f"{srv.base_url}/v1/cache").json()["entries"] == 0


@pytest.mark.parametrize(
    "header",
    [
        "Bearer k\xe9y-a".encode("latin-1"),  # not ASCII
        "Bearer ключ".encode(),  # not ASCII either, as UTF-8 bytes
        b"Bearer \xff\xfe",
        b"Bearer",
        b"Bearer ",
        b"Basic a2V5LWE6",
        b"bearer",
        b"key-a",
        b"",
    ],
)
def test_a_malformed_authorization_is_a_401(keyed, header):
    # a raw socket: HTTP clients refuse to send some of these
    with socket.create_connection((keyed.host, keyed.port), timeout=30) as s:
        s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\nAuthorization: " + header + b"\r\n\r\n")
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.split()[1] == b"401", reply
    assert json.loads(body)["error"]["code"] == "invalid_api_key"


def test_keys_are_compared_as_sent(make_service):
    """A configured key that is not ASCII works when sent as UTF-8."""
    with BackgroundServer(make_service("qwen3_5", api_keys=("clé",))) as srv:
        ok = httpx.get(f"{srv.base_url}/v1/models", headers=[(b"Authorization", "Bearer clé".encode())])
        assert ok.status_code == 200
        bad = httpx.get(f"{srv.base_url}/v1/models", headers=[(b"Authorization", "Bearer clé".encode("latin-1"))])
        assert bad.status_code == 401


def test_the_api_document_is_behind_the_key_and_documents_400(keyed):
    assert httpx.get(f"{keyed.base_url}/openapi.json").status_code == 401
    assert httpx.get(f"{keyed.base_url}/docs").status_code == 401  # no route, and no hint of one without a key
    doc = httpx.get(f"{keyed.base_url}/openapi.json", headers=auth(KA)).json()
    for path in ("/v1/chat/completions", "/v1/completions"):
        responses = doc["paths"][path]["post"]["responses"]
        assert "422" not in responses and "400" in responses
        assert responses["400"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")
    assert "HTTPValidationError" not in doc["components"]["schemas"]
    assert set(doc["components"]["schemas"]["ErrorDetail"]["properties"]) == {"message", "type", "param", "code"}
    assert httpx.get(f"{keyed.base_url}/health").status_code == 200  # the probes stay open


def test_a_chunked_body_over_the_limit_is_a_413(keyed):
    def chunks():
        for _ in range(10):
            yield b" " * 1000  # 10 kB against a 4000-byte limit, with no Content-Length

    r = httpx.post(
        f"{keyed.base_url}/v1/chat/completions",
        content=chunks(),
        headers={**auth(KA), "content-type": "application/json"},
    )
    assert r.request.headers.get("transfer-encoding") == "chunked"
    assert r.status_code == 413, r.text
    assert r.json()["error"]["code"] == "request_too_large"
    # the same size with a Content-Length is refused before it is read
    r = httpx.post(f"{keyed.base_url}/v1/chat/completions", content=b" " * 10000, headers=auth(KA))
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

"""Conformance with the published APIs: every response body and every streamed chunk or event of the OpenAI
routes validates against OpenAI's OpenAPI document (../shared/fixtures/specs, see its SOURCES.md) with
`jsonschema`, and every `/v1/messages` body and event against the `anthropic` SDK's own types in strict mode.
Requests go through the official clients with strict response validation on; a recording transport keeps
the raw bytes they read, which are what is validated. One real server on a tiny Qwen3.5 model with its real
template; tool calls and reasoning are forced (`force`). An error from every route, refused by the route or by the
guards ahead of it, comes in that route's API's shape."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import httpx
import openai
import pytest
from openai import OpenAI

from ..conftest import QWEN35_TEMPLATE, wait_idle
from ..parsers.helpers import TOOLS

jsonschema = pytest.importorskip("jsonschema")
referencing = pytest.importorskip("referencing")
anthropic = pytest.importorskip("anthropic")

from pydantic import TypeAdapter  # noqa: E402
from referencing.jsonschema import DRAFT202012  # noqa: E402

SPEC = Path(__file__).resolve().parents[2].parent / "shared" / "fixtures" / "specs" / "openai-openapi.json"
QWEN35 = ("qwen3_5", QWEN35_TEMPLATE)
XML_CALL = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n"
    "</parameter>\n</function>\n</tool_call>"
)
THOUGHT = "The user wants weather.\n</think>"  # the prompt opened the block: the reply closes it
REPLY = THOUGHT + "\n\nChecking.\n\n" + XML_CALL
ASK = [{"role": "user", "content": "Weather in Paris?"}]
FLAT_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]
ANTHROPIC_TOOLS = [
    {
        "name": t["function"]["name"],
        "description": t["function"].get("description", ""),
        "input_schema": t["function"]["parameters"],
    }
    for t in TOOLS
]
STREAM_SCHEMAS = {  # the document's schema of each Responses stream event
    "response.created": "ResponseCreatedEvent",
    "response.in_progress": "ResponseInProgressEvent",
    "response.completed": "ResponseCompletedEvent",
    "response.incomplete": "ResponseIncompleteEvent",
    "response.output_item.added": "ResponseOutputItemAddedEvent",
    "response.output_item.done": "ResponseOutputItemDoneEvent",
    "response.content_part.added": "ResponseContentPartAddedEvent",
    "response.content_part.done": "ResponseContentPartDoneEvent",
    "response.output_text.delta": "ResponseTextDeltaEvent",
    "response.output_text.done": "ResponseTextDoneEvent",
    "response.reasoning_text.delta": "ResponseReasoningTextDeltaEvent",
    "response.reasoning_text.done": "ResponseReasoningTextDoneEvent",
    "response.function_call_arguments.delta": "ResponseFunctionCallArgumentsDeltaEvent",
    "response.function_call_arguments.done": "ResponseFunctionCallArgumentsDoneEvent",
    "response.failed": "ResponseFailedEvent",
    "error": "ResponseErrorEvent",
}


# -- the OpenAPI document as a JSON Schema registry ------------------------------------------------------------
def _nullable(node):
    """The OpenAPI 3.0 `nullable: true` left in the 3.1 document (which JSON Schema 2020-12 ignores) as
    what it means: null allowed too."""
    if isinstance(node, list):
        return [_nullable(n) for n in node]
    if not isinstance(node, dict):
        return node
    node = {k: _nullable(v) for k, v in node.items()}
    if node.pop("nullable", False):
        if isinstance(node.get("type"), str):
            node["type"] = [node["type"], "null"]
            if "enum" in node:
                node["enum"] = [*node["enum"], None]
        else:  # a $ref, allOf or oneOf
            node = {"anyOf": [node, {"type": "null"}]}
    return node


@pytest.fixture(scope="module")
def spec():
    """validate(schema name, instance): raises on any violation of the document's component schema."""
    if not SPEC.is_file():
        pytest.skip(f"OpenAI's OpenAPI document not found at {SPEC}")
    doc = _nullable(json.loads(SPEC.read_text()))
    schemas = doc["components"]["schemas"]
    # Quirk: streamed completions reuse CreateCompletionResponse, whose finish_reason is non-null, while the API
    # streams null until the last chunk. A copy for the chunks allows null there, and only there.
    chunk = schemas["CompletionStreamChunk"] = copy.deepcopy(schemas["CreateCompletionResponse"])
    finish = chunk["properties"]["choices"]["items"]["properties"]["finish_reason"]
    finish["type"], finish["enum"] = [finish["type"], "null"], [*finish["enum"], None]
    registry = referencing.Registry().with_resource("urn:openai", DRAFT202012.create_resource(doc))
    validators: dict[str, jsonschema.Draft202012Validator] = {}

    def validate(name: str, instance) -> None:
        if name not in validators:
            validators[name] = jsonschema.Draft202012Validator(
                {"$ref": f"urn:openai#/components/schemas/{name}"}, registry=registry
            )
        errors = list(validators[name].iter_errors(instance))
        assert not errors, f"{name}: " + "; ".join(f"{list(e.path)}: {e.message[:300]}" for e in errors[:5])

    return validate


# -- clients whose raw responses are kept -------------------------------------------------------------------
def recording(http):
    """An `http.Client` (`http`: httpx, or the httpx2 the anthropic SDK is built on) that keeps each response's
    status and raw body as its reader reads them, in `.seen`."""
    seen: list[tuple[int, bytearray]] = []

    class Recording(http.BaseTransport):
        def __init__(self):
            self.inner = http.HTTPTransport()

        def handle_request(self, request):
            response = self.inner.handle_request(request)
            body = bytearray()
            seen.append((response.status_code, body))

            class Tee(http.SyncByteStream):
                def __iter__(self):
                    for part in response.stream:
                        body.extend(part)
                        yield part

                def close(self):
                    response.close()

            return http.Response(
                response.status_code, headers=response.headers, stream=Tee(), extensions=response.extensions
            )

        def close(self):
            self.inner.close()

    client = http.Client(transport=Recording(), timeout=60)
    client.seen = seen
    return client


def sse(body: bytes) -> list[tuple[str | None, str]]:
    """A stream's (event name, data) pairs."""
    out = []
    for block in body.decode().replace("\r\n", "\n").split("\n\n"):
        name, data = None, []
        for line in block.split("\n"):
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].removeprefix(" "))
        if data:
            out.append((name, "\n".join(data)))
    return out


def http_package(sdk):
    """The httpx package an SDK is built on: httpx, or its fork httpx2 in recent anthropic versions (whose
    clients refuse an httpx.Client)."""
    base = next(c for c in sdk.DefaultHttpxClient.__mro__[1:] if c.__name__ == "Client")
    return sys.modules[base.__module__.split(".")[0]]


@pytest.fixture(scope="module")
def srv(template_servers):
    return template_servers(*QWEN35)


def recording_openai(server) -> OpenAI:
    """The openai client on `server`, strict, its raw responses kept (`last`)."""
    http = recording(httpx)
    client = OpenAI(
        base_url=f"{server.base_url}/v1",
        api_key="unused",
        max_retries=0,
        http_client=http,
        _strict_response_validation=True,
    )
    client.recorded = http
    return client


@pytest.fixture
def openai_client(srv):
    client = recording_openai(srv)
    yield client
    client.close()


@pytest.fixture
def anthropic_client(srv):
    http = recording(http_package(anthropic))
    client = anthropic.Anthropic(
        base_url=srv.base_url, api_key="unused", max_retries=0, http_client=http, _strict_response_validation=True
    )
    client.recorded = http
    yield client
    client.close()


def last(client) -> tuple[int, bytes]:
    """The status and raw body of the client's last response."""
    status, body = client.recorded.seen[-1]
    return status, bytes(body)


def body_of(client) -> dict:
    return json.loads(last(client)[1])


def chunks_of(client) -> list[dict]:
    """The stream's JSON chunks, after checking it ends with `[DONE]`."""
    _, body = last(client)
    events = sse(body)
    assert events and events[-1][1] == "[DONE]"
    return [json.loads(data) for _, data in events[:-1]]


# -- chat completions ---------------------------------------------------------------------------------------
def chat(client, **kw):
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(model="tpl", messages=ASK, **kw)


def test_chat_completions(openai_client, spec):
    for kw in (
        {"max_tokens": 4},
        {"max_tokens": 4, "logprobs": True, "top_logprobs": 2},
        {"max_tokens": 4, "n": 2, "temperature": 1, "seed": 3},
    ):
        resp = chat(openai_client, **kw)
        body = body_of(openai_client)
        spec("CreateChatCompletionResponse", body)
        assert len(body["choices"]) == kw.get("n", 1) == len(resp.choices)
        assert all("refusal" in c["message"] and c["message"]["refusal"] is None for c in body["choices"])
    assert [
        c
        for c in chat(
            openai_client, max_tokens=4, n=2, temperature=1, seed=3, stream=True, stream_options={"include_usage": True}
        )
    ]
    chunks = chunks_of(openai_client)
    for chunk in chunks:
        spec("CreateChatCompletionStreamResponse", chunk)
    assert {c["choices"][0]["index"] for c in chunks[:-1]} == {0, 1} and chunks[-1]["usage"]["completion_tokens"] == 8


def test_chat_completion_tool_call_whole_and_streamed(openai_client, spec, srv, force):
    rt = srv.service.runtime
    resp = chat(openai_client, tools=TOOLS, max_tokens=128, seed=force(rt, REPLY))
    body = body_of(openai_client)
    spec("CreateChatCompletionResponse", body)
    assert resp.choices[0].finish_reason == "tool_calls" and resp.choices[0].message.tool_calls
    assert body["choices"][0]["message"]["refusal"] is None
    stream = chat(
        openai_client,
        tools=TOOLS,
        max_tokens=128,
        seed=force(rt, REPLY),
        stream=True,
        stream_options={"include_usage": True},
        logprobs=True,
        top_logprobs=1,
    )
    assert [c for c in stream]
    chunks = chunks_of(openai_client)
    for chunk in chunks:
        spec("CreateChatCompletionStreamResponse", chunk)
    assert chunks[-1]["usage"]["completion_tokens"] > 0 and chunks[-1]["choices"] == []
    assert any(d["delta"].get("tool_calls") for c in chunks for d in c["choices"])


# -- completions ------------------------------------------------------------------------------------------
def test_completions_whole_and_streamed(openai_client, spec):
    for extra in ({"logprobs": 2}, {"echo": True}):
        openai_client.completions.create(model="tpl", prompt="Once upon", max_tokens=4, temperature=0, **extra)
        spec("CreateCompletionResponse", body_of(openai_client))
    # Quirk: the SDK's Completion type copies the document's non-null finish_reason, so the client read in
    # strict mode refuses the null of every chunk but the last (as it would OpenAI's own): the raw stream only
    with openai_client.completions.with_streaming_response.create(
        model="tpl",
        prompt="Once upon",
        max_tokens=4,
        temperature=0,
        logprobs=1,
        stream=True,
        stream_options={"include_usage": True},
    ) as raw:
        raw.read()
    chunks = chunks_of(openai_client)
    for chunk in chunks[:-1]:
        spec("CompletionStreamChunk", chunk)
    spec("CreateCompletionResponse", chunks[-1])  # the usage chunk: no choices, so nothing null to allow


# -- responses --------------------------------------------------------------------------------------------
def responses_events(client, spec) -> list[dict]:
    _, body = last(client)
    events = []
    for name, data in sse(body):
        event = json.loads(data)
        assert name == event["type"]
        if name in ("response.created", "response.in_progress", "response.failed"):
            # Quirk: these events carry `usage: null` (nothing is counted yet, or nothing counted as the failed
            # response's, as in the document's own example), which the Response schema does not allow; the rest
            # of the snapshot is checked as it is
            assert event["response"]["usage"] is None
            event = {**event, "response": {k: v for k, v in event["response"].items() if k != "usage"}}
        spec(STREAM_SCHEMAS[name], event)
        spec("ResponseStreamEvent", event)
        events.append(event)
    return events


def test_responses_whole_and_streamed_with_a_tool_call(openai_client, spec, srv, force):
    rt = srv.service.runtime
    openai_client.responses.create(model="tpl", input="Hello", max_output_tokens=4, temperature=0)
    spec("Response", body_of(openai_client))
    resp = openai_client.responses.create(
        model="tpl", input="Weather in Paris?", tools=FLAT_TOOLS, extra_body={"seed": force(rt, REPLY)}
    )
    body = body_of(openai_client)
    spec("Response", body)
    assert [o["type"] for o in body["output"]] == ["reasoning", "message", "function_call"]
    assert all(t["strict"] is None for t in body["tools"])  # the request did not set it
    thought = len(rt.tokenizer(THOUGHT, add_special_tokens=False)["input_ids"])
    assert body["usage"]["output_tokens_details"]["reasoning_tokens"] == thought
    assert body["usage"]["input_tokens_details"]["cache_write_tokens"] == 0
    client_view = openai_client.responses.retrieve(resp.id)
    spec("Response", body_of(openai_client))
    assert client_view.usage.output_tokens_details.reasoning_tokens == thought

    strict_tools = [{**t, "strict": False} for t in FLAT_TOOLS]
    with openai_client.responses.stream(
        model="tpl", input="Weather in Paris?", tools=strict_tools, extra_body={"seed": force(rt, REPLY)}
    ) as stream:
        final = stream.get_final_response()
    events = responses_events(openai_client, spec)
    assert events[-1]["type"] == "response.completed" and final.tools[0].strict is False
    assert events[-1]["response"]["usage"]["output_tokens_details"]["reasoning_tokens"] == thought


def test_responses_cut_off_while_reasoning_count_every_token(openai_client, spec):
    assert [
        e
        for e in openai_client.responses.create(
            model="tpl", input="Hello", max_output_tokens=5, temperature=0, stream=True
        )
    ]
    done = responses_events(openai_client, spec)[-1]
    assert done["type"] == "response.incomplete"
    usage = done["response"]["usage"]  # the template opens a <think> block the random model never closes
    assert usage["output_tokens"] == 5 and usage["output_tokens_details"]["reasoning_tokens"] == 5


def test_a_responses_stream_asked_for_usage_ends_as_any_other(openai_client, spec):
    """`stream_options.include_usage` (accepted on every generating route) adds nothing to a Responses stream:
    its last event carries the usage."""
    assert [
        e
        for e in openai_client.responses.create(
            model="tpl",
            input="Hello",
            max_output_tokens=3,
            temperature=0,
            stream=True,
            extra_body={"stream_options": {"include_usage": True}},
        )
    ]
    done = responses_events(openai_client, spec)[-1]
    assert done["type"] == "response.incomplete" and done["response"]["usage"]["output_tokens"] == 3


def test_a_failed_responses_stream_ends_with_response_failed(template_servers, spec):
    """A generation that fails (here: times out) ends the stream with `response.failed`, whose response says
    why, holds what was streamed, and is not stored."""
    client = recording_openai(template_servers(*QWEN35, request_timeout=0.05))
    # min_tokens: the random model cannot end its turn before the timeout does
    got = [
        e
        for e in client.responses.create(
            model="tpl",
            input="Hello",
            max_output_tokens=3000,
            temperature=0,
            stream=True,
            extra_body={"min_tokens": 3000},
        )
    ]
    events = responses_events(client, spec)
    assert [e["type"] for e in events][:2] == ["response.created", "response.in_progress"]
    failed = events[-1]
    assert failed["type"] == "response.failed" and got[-1].type == "response.failed"
    assert failed["response"]["status"] == "failed" and failed["response"]["error"] == {
        "code": "server_error",
        "message": "request timed out",
    }
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert not [e for e in events if e["type"] in ("error", "response.completed", "response.incomplete")]
    streamed = [e for e in events if e["type"] == "response.output_item.added"]
    assert len(failed["response"]["output"]) == len(streamed)
    assert all(item["status"] != "in_progress" for item in failed["response"]["output"])
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(failed["response"]["id"])
    client.close()


# -- models and errors -----------------------------------------------------------------------------------
def test_models_list_and_get(openai_client, spec):
    listed = openai_client.models.list()
    body = body_of(openai_client)
    spec("ListModelsResponse", body)
    assert [m.id for m in listed.data] == ["tpl"]
    one = openai_client.models.retrieve("tpl")
    spec("Model", body_of(openai_client))
    assert one.id == "tpl" and body_of(openai_client) == body["data"][0]
    with pytest.raises(openai.NotFoundError):
        openai_client.models.retrieve("no-such-model")
    status, raw = last(openai_client)
    assert status == 404
    spec("ErrorResponse", json.loads(raw))
    assert json.loads(raw)["error"]["code"] == "model_not_found"


@pytest.mark.parametrize(
    "call",
    [
        lambda c: c.chat.completions.create(model="tpl", messages=ASK, max_tokens=0),
        lambda c: c.chat.completions.create(model="other", messages=ASK, max_tokens=2),
        lambda c: c.completions.create(model="tpl", prompt="x", max_tokens=2, temperature=-1),
        lambda c: c.responses.create(model="tpl", input="x", previous_response_id="resp_unknown"),
        lambda c: c.responses.create(model="tpl", input="x", tools=[{"type": "web_search"}]),
    ],
    ids=["chat-400", "chat-404", "completions-400", "responses-404", "responses-400"],
)
def test_error_bodies(openai_client, spec, call):
    with pytest.raises(openai.APIStatusError):
        call(openai_client)
    status, raw = last(openai_client)
    assert status in (400, 404)
    spec("ErrorResponse", json.loads(raw))


# -- Anthropic messages ------------------------------------------------------------------------------------
STREAM_EVENT = TypeAdapter(anthropic.types.RawMessageStreamEvent)


def message_events(client) -> list:
    _, body = last(client)
    out = []
    for name, data in sse(body):
        event = STREAM_EVENT.validate_json(data, strict=True)
        assert event.type == name
        out.append(event)
    return out


def test_messages_bodies_and_events(anthropic_client, srv, force):
    rt = srv.service.runtime
    kw = dict(model="tpl", messages=ASK, tools=ANTHROPIC_TOOLS, max_tokens=128)
    msg = anthropic_client.messages.create(**kw, extra_body={"seed": force(rt, REPLY)})
    _, raw = last(anthropic_client)
    whole = anthropic.types.Message.model_validate_json(raw, strict=True)
    assert [b.type for b in whole.content] == ["thinking", "text", "tool_use"] == [b.type for b in msg.content]
    wait_idle(srv.service)  # the same prompt again: most of it read from the cache
    with anthropic_client.messages.stream(**kw, extra_body={"seed": force(rt, REPLY)}) as stream:
        final = stream.get_final_message()
    events = message_events(anthropic_client)
    start, delta = events[0], events[-2]
    assert start.type == "message_start" and delta.type == "message_delta" and events[-1].type == "message_stop"
    # message_start splits the prompt as the final usage does (Anthropic's: input_tokens without the cached)
    usage = start.message.usage
    cached = usage.cache_read_input_tokens
    assert cached is not None and cached > 0
    assert cached == delta.usage.cache_read_input_tokens == final.usage.cache_read_input_tokens
    assert usage.input_tokens == delta.usage.input_tokens == final.usage.input_tokens
    assert (
        usage.input_tokens + usage.cache_read_input_tokens
        == whole.usage.input_tokens + whole.usage.cache_read_input_tokens
    )


def test_messages_error_body(anthropic_client):
    with pytest.raises(anthropic.BadRequestError):
        anthropic_client.messages.create(model="tpl", messages=[], max_tokens=2)
    status, raw = last(anthropic_client)
    assert status == 400
    anthropic.types.ErrorResponse.model_validate_json(raw, strict=True)


# -- every route's errors in its own API's shape --------------------------------------------------------------
ANTHROPIC_ROUTES = {"/v1/messages", "/v1/messages/count_tokens"}  # every other route answers in OpenAI's shape
ANTHROPIC_TYPES = {  # status -> error type, as Anthropic documents them (405: no such route is documented)
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
}
URLS = {"/v1/models/{model:path}": "/v1/models/no-such-model", "/v1/responses/{rid}": "/v1/responses/resp_none"}
LONG = "lorem ipsum dolor " * (3_000_000 // 18)  # far over the tiny model's context, refused from its length
BODIES = {  # a request each POST route serves, and the field its prompt goes in (None: it has none)
    "/v1/chat/completions": ({"messages": ASK, "max_tokens": 2}, "messages"),
    "/v1/completions": ({"prompt": "hi", "max_tokens": 2}, "prompt"),
    "/tokenize": ({"prompt": "hi"}, "prompt"),
    "/detokenize": ({"tokens": [1]}, None),
    "/v1/responses": ({"input": "hi", "max_output_tokens": 2}, "input"),
    "/v1/messages": ({"messages": ASK, "max_tokens": 2}, "messages"),
    "/v1/messages/count_tokens": ({"messages": ASK}, "messages"),
}


def app_routes() -> list[tuple[str, str]]:
    """(method, path) of every route the app serves, from its routers."""
    from hyserve.server.app import ROUTERS

    return sorted((m, r.path) for s in ROUTERS for r in s.router.routes for m in r.methods)


def with_prompt(body: dict, field: str, text: str) -> dict:
    return {**body, field: [{"role": "user", "content": text}] if field == "messages" else text}


def error_cases() -> list:
    """(what, method, path as requested, route path, request kwargs, status): a malformed JSON body, an unknown
    model and an over-long prompt on every route that reads them, a method no route serves on every route."""
    cases = []

    def case(what: str, method: str, url: str, path: str, kw: dict, status: int) -> None:
        cases.append(pytest.param(what, method, url, path, kw, status, id=f"{method}-{url}-{what}"))

    for method, path in app_routes():
        url = URLS.get(path, path)
        case("method", "PATCH", url, path, {}, 405)
        if method == "POST":
            body, field = BODIES[path]
            case("bad-json", method, url, path, {"content": b"{", "headers": {"content-type": "application/json"}}, 400)
            case("unknown-model", method, url, path, {"json": {**body, "model": "x"}}, 404)
            if field is not None:
                case("over-long", method, url, path, {"json": with_prompt({**body, "model": "tpl"}, field, LONG)}, 400)
        elif url != path:  # a route naming an object (the model, a stored response) that does not exist
            case("unknown", method, url, path, {}, 404)
    return cases


@pytest.fixture(scope="module")
def check_shape(spec):
    """check(route path, response): the response is an error body in the shape of that route's API."""

    def check(path: str, resp: httpx.Response) -> None:
        if path in ANTHROPIC_ROUTES:
            body = resp.json()
            assert set(body) == {"type", "error"} and set(body["error"]) == {"type", "message"}, resp.text
            assert body["error"]["type"] == ANTHROPIC_TYPES[resp.status_code] and body["error"]["message"]
            if body["error"]["type"] != "request_too_large":  # documented, but not among the SDK's types
                anthropic.types.ErrorResponse.model_validate_json(resp.content, strict=True)
        else:
            spec("ErrorResponse", resp.json())
        assert "Traceback" not in resp.text

    return check


def test_every_post_route_has_a_request_to_fail():
    """A new route joins the error-shape tests below: a POST route needs its body in BODIES."""
    posts = {p for m, p in app_routes() if m == "POST"}
    assert posts == set(BODIES)
    assert {p for _, p in app_routes()} >= ANTHROPIC_ROUTES | set(URLS)


@pytest.mark.parametrize("what,method,url,path,kw,status", error_cases())
def test_an_error_comes_in_its_routes_shape(srv, check_shape, what, method, url, path, kw, status):
    rt = srv.service.runtime
    assert rt.chars_per_token and len(LONG) > rt.chars_per_token * rt.max_model_len  # "refused from its length"
    resp = httpx.request(method, f"{srv.base_url}{url}", timeout=60, **kw)
    assert resp.status_code == status, resp.text
    check_shape(path, resp)
    if what == "over-long" and path not in ANTHROPIC_ROUTES:
        assert resp.json()["error"]["code"] == "context_length_exceeded"


@pytest.mark.parametrize("method,path", [r for r in app_routes() if r[1] not in ("/health", "/metrics")])
def test_a_guards_refusal_comes_in_its_routes_shape(template_servers, check_shape, method, path):
    """The guards answer before any route runs (no key: 401; a body over the limit: 413), in the shape of the
    route the request was for."""
    srv = template_servers(*QWEN35, api_keys=("key-a",), max_body_bytes=4096)
    url = f"{srv.base_url}{URLS.get(path, path)}"
    no_key = httpx.request(method, url, timeout=60)
    assert no_key.status_code == 401, no_key.text
    check_shape(path, no_key)
    if method == "POST":
        big = httpx.post(url, headers={"authorization": "Bearer key-a"}, json={"prompt": "x" * 8192}, timeout=60)
        assert big.status_code == 413, big.text
        check_shape(path, big)


def test_the_api_document_gives_each_route_its_error_shape(srv):
    doc = httpx.get(f"{srv.base_url}/openapi.json", timeout=60).json()
    for method, path in app_routes():
        responses = doc["paths"][path.replace(":path", "")][method.lower()]["responses"]
        expected = "AnthropicErrorResponse" if path in ANTHROPIC_ROUTES else "ErrorResponse"
        assert responses["default"]["content"]["application/json"]["schema"]["$ref"].endswith("/" + expected)
    assert doc["components"]["schemas"]["AnthropicErrorResponse"]["required"] == ["type", "error"]

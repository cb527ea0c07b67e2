"""`/v1/responses` through the real `openai` client against real servers on tiny models with the real Qwen3.5
template: text, streaming events, forced reasoning and tool calls, `store` and `previous_response_id` (whose
turn restores all of the previous prompt and output from the cache, and equals the cache-off reply), the
tenant namespace and errors in OpenAI's shape."""

import json

import httpx
import openai
import pytest
from openai import OpenAI

from hyserve.server.response_store import ResponseStore
from hyserve.testing.tiny import ARCHS

from ..conftest import QWEN35_TEMPLATE
from ..parsers.helpers import TOOLS

QWEN35 = ("qwen3_5", QWEN35_TEMPLATE)
XML_CALL = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n"
    "</parameter>\n</function>\n</tool_call>"
)
REPLY = "The user wants weather.\n</think>\n\nChecking.\n\n" + XML_CALL
HI = "Greeting.\n</think>\n\nHi."  # reasoning, then the answer
FLAT_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]


def client(srv, key: str = "unused") -> OpenAI:
    return OpenAI(base_url=f"{srv.base_url}/v1", api_key=key, max_retries=0)


def create(srv, key: str = "unused", **kw):
    kw.setdefault("temperature", 0)
    return client(srv, key).responses.create(model="tpl", **kw)


def two_turns(srv, **first):
    first.setdefault("max_output_tokens", 6)
    r1 = create(srv, instructions="Be terse.", input="Hello there", **first)
    r2 = create(
        srv,
        input=[{"role": "user", "content": [{"type": "input_text", "text": "And then?"}]}],
        previous_response_id=r1.id,
        max_output_tokens=6,
    )
    return r1, r2


def test_previous_response_id_restores_the_whole_previous_turn(template_servers, force):
    on, off = template_servers(*QWEN35), template_servers(*QWEN35, cache_enabled=False)
    forced = {"max_output_tokens": 32, "extra_body": {"seed": force(on.service.runtime, HI)}}
    for extra in ({}, forced):  # the first reply cut by length, then one that ends its turn itself
        r1, r2 = two_turns(on, **extra)
        assert r1.status == ("incomplete" if not extra else "completed") and r1.object == "response"
        assert r2.previous_response_id == r1.id and r2.instructions == "Be terse."
        previous = r1.usage.input_tokens + r1.usage.output_tokens
        assert r2.usage.input_tokens_details.cached_tokens == previous < r2.usage.input_tokens
        if extra:
            assert r1.output_text == "Hi."
            extra = {**extra, "extra_body": {"seed": force(off.service.runtime, HI)}}
        o1, o2 = two_turns(off, **extra)
        assert (o1.output_text, o2.output_text) == (r1.output_text, r2.output_text)
        assert o2.usage.input_tokens == r2.usage.input_tokens and o2.usage.input_tokens_details.cached_tokens == 0
        assert client(on).responses.retrieve(r2.id).output_text == r2.output_text
        r3 = create(on, input="Once more", previous_response_id=r2.id, max_output_tokens=3)  # a chain
        assert r3.usage.input_tokens_details.cached_tokens == r2.usage.input_tokens + r2.usage.output_tokens


def test_streamed_events_join_to_the_response(template_servers):
    srv = template_servers(*QWEN35)
    whole = create(srv, input="Tell me a story", max_output_tokens=8, store=False)
    events = list(create(srv, input="Tell me a story", max_output_tokens=8, store=False, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.incomplete"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    assert final.incomplete_details.reason == "max_output_tokens" and final.usage.output_tokens == 8
    deltas = "".join(
        e.delta for e in events if e.type in ("response.output_text.delta", "response.reasoning_text.delta")
    )
    texts = [c.text for item in whole.output for c in item.content or []]
    assert final.output_text == whole.output_text and deltas == "".join(texts)
    with pytest.raises(openai.NotFoundError):  # store=False: nothing to continue
        create(srv, input="more", previous_response_id=final.id)


def test_forced_reasoning_and_tool_call_then_its_output(template_servers, force):
    srv = template_servers(*QWEN35)
    rt = srv.service.runtime
    r1 = create(srv, input="Weather in Paris?", tools=FLAT_TOOLS, extra_body={"seed": force(rt, REPLY)})
    kinds = [item.type for item in r1.output]
    assert kinds == ["reasoning", "message", "function_call"]
    assert r1.output[0].content[0].text == "The user wants weather." and r1.output_text == "Checking."
    call = r1.output[2]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris", "days": 3}

    with client(srv).responses.stream(
        model="tpl", input="Weather in Paris?", tools=FLAT_TOOLS, temperature=0, extra_body={"seed": force(rt, REPLY)}
    ) as stream:
        final = stream.get_final_response()
    assert [i.type for i in final.output] == kinds and final.output_text == "Checking."
    assert json.loads(final.output[2].arguments) == json.loads(call.arguments)

    r2 = create(
        srv,
        previous_response_id=r1.id,
        tools=FLAT_TOOLS,
        max_output_tokens=4,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}],
    )
    assert r2.usage.input_tokens_details.cached_tokens == r1.usage.input_tokens + r1.usage.output_tokens


def test_stored_responses_are_namespaced_by_api_key(template_servers):
    srv = template_servers(*QWEN35, api_keys=("key-a", "key-b"))
    r1 = create(srv, "key-a", input="Hello", max_output_tokens=3)
    assert client(srv, "key-a").responses.retrieve(r1.id).id == r1.id
    with pytest.raises(openai.NotFoundError):
        client(srv, "key-b").responses.retrieve(r1.id)
    with pytest.raises(openai.NotFoundError) as exc:
        create(srv, "key-b", input="more", previous_response_id=r1.id)
    assert exc.value.body["param"] == "previous_response_id"
    client(srv, "key-a").responses.delete(r1.id)
    with pytest.raises(openai.NotFoundError):
        client(srv, "key-a").responses.retrieve(r1.id)


@pytest.mark.parametrize(
    "body,param",
    [
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0]"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]},
            "input[0].content[0]",
        ),
        ({"input": [{"type": "computer_call"}]}, "input[0].type"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
        ({"input": "x", "previous_response_id": "resp_nope"}, "previous_response_id"),
        ({"input": []}, "input"),
    ],
)
def test_bad_input_is_a_400_or_404_in_openai_shape(template_servers, body, param):
    srv = template_servers(*QWEN35)
    r = httpx.post(f"{srv.base_url}/v1/responses", json={"model": "tpl", **body}, timeout=30)
    assert r.status_code in (400, 404), r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"]


def test_store_keeps_to_its_byte_budget():
    store = ResponseStore(budget_bytes=4000)
    for i in range(10):
        assert store.put("t", f"r{i}", list(range(100)), {"id": f"r{i}"}, None)
    assert store.used <= 4000 and 0 < len(store) < 10
    assert store.get("t", "r9") is not None and store.get("t", "r0") is None
    assert store.get("other", "r9") is None
    assert not store.put("t", "big", list(range(1000)), {}, None)  # alone over the budget: refused, not stored


@pytest.mark.parametrize("arch", ARCHS)
def test_continuation_is_exact_on_every_family(servers, make_service, arch):
    """Each family's tiny model with its default template: the continued turn reads all of the previous
    one from the cache and answers as a server without a cache does."""
    from hyserve.server.run import BackgroundServer

    on = servers(arch)
    with BackgroundServer(make_service(arch, cache_enabled=False)) as off:
        turns = []
        for srv in (on, off):
            model = srv.service.model_name
            kw = {"model": model, "temperature": 0, "max_output_tokens": 5}
            r1 = client(srv).responses.create(input="Count to three", **kw)
            r2 = client(srv).responses.create(input="Again", previous_response_id=r1.id, **kw)
            turns.append((r1, r2))
    (r1, r2), (o1, o2) = turns
    assert r2.usage.input_tokens_details.cached_tokens == r1.usage.input_tokens + r1.usage.output_tokens
    assert (o1.output_text, o2.output_text) == (r1.output_text, r2.output_text)
    assert o2.usage.input_tokens == r2.usage.input_tokens


def test_continuation_after_speculative_decoding(make_service):
    """Prompt-lookup speculation leaves the state at prompt + output[:-1] too: the final token is fed and the
    continued turn still reads everything (a repetitive input, so proposals are made and verified)."""
    from hyserve.engine.speculative import SpeculativeConfig
    from hyserve.server.run import BackgroundServer

    with BackgroundServer(make_service("qwen3_5", speculative=SpeculativeConfig(4, 2))) as srv:
        kw = {"model": srv.service.model_name, "temperature": 0, "max_output_tokens": 24}
        r1 = client(srv).responses.create(input="a b c a b c a b c a b c", **kw)
        r2 = client(srv).responses.create(input="a b c", previous_response_id=r1.id, **kw)
        proposed = srv.service.metrics.spec_proposed._value.get()
    assert proposed > 0
    assert r2.usage.input_tokens_details.cached_tokens == r1.usage.input_tokens + r1.usage.output_tokens

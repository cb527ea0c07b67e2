"""Agents back to back through real servers (issue 35): an openai-agents `@function_tool` with a pydantic
signature runs with typed arguments from a Qwen3.5 XML call, and a Llama 3.1 agent whose model writes two
calls at once (`{..}; {..}`) keeps going, since its template renders only one call per message. Replies are
forced (`force`)."""

import asyncio
from typing import Literal

import pytest
from pydantic import BaseModel

from .test_tools_reasoning import ASK, LLAMA3, QWEN35, TOOLS, create, streamed


class Units(BaseModel):
    unit: Literal["C", "F"]
    precision: int | None = None


XML_FORECAST = (
    "Forecast it.\n</think>\n\n<tool_call>\n<function=forecast>\n<parameter=city>\nParis\n</parameter>\n"
    '<parameter=days>\n3\n</parameter>\n<parameter=units>\n{"unit": "C", "precision": 1}\n'
    "</parameter>\n</function>\n</tool_call>"
)
ANSWER = "Done.\n</think>\n\nParis: sunny for 3 days."


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_openai_agents_function_tool_runs_with_typed_arguments(template_servers, force, stream):
    agents = pytest.importorskip("agents")
    from openai import AsyncOpenAI

    srv = template_servers(*QWEN35)
    rt = srv.service.runtime
    ran = []

    @agents.function_tool
    def forecast(city: str, days: int | None, units: Units | None) -> str:
        """The weather forecast for a city."""
        ran.append((city, days, units))
        return f"{city}: sunny for {days} days"

    class Answer(agents.AgentHooks):
        async def on_tool_end(self, context, agent, tool, result):  # the next model call writes the answer
            agent.model_settings = agents.ModelSettings(extra_body={"seed": force(rt, ANSWER)})

    client = AsyncOpenAI(base_url=f"{srv.base_url}/v1", api_key="unused", max_retries=0)
    agent = agents.Agent(
        name="weather",
        tools=[forecast],
        hooks=Answer(),
        model=agents.OpenAIChatCompletionsModel(model="tpl", openai_client=client),
        model_settings=agents.ModelSettings(extra_body={"seed": force(rt, XML_FORECAST)}),
    )
    config = agents.RunConfig(tracing_disabled=True)

    async def run():
        if not stream:
            return await agents.Runner.run(agent, "Weather in Paris for 3 days, in Celsius?", run_config=config)
        result = agents.Runner.run_streamed(agent, "Weather in Paris for 3 days, in Celsius?", run_config=config)
        async for _ in result.stream_events():
            pass
        return result

    result = asyncio.run(run())
    assert ran == [("Paris", 3, Units(unit="C", precision=1))]
    outputs = [item.output for item in result.new_items if isinstance(item, agents.ToolCallOutputItem)]
    assert outputs == ["Paris: sunny for 3 days"]
    assert result.final_output == "Paris: sunny for 3 days."


LLAMA_CALL = '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}'
TWO_CALLS = LLAMA_CALL + "; " + LLAMA_CALL.replace("Paris", "Rome")


def test_llama3_agent_loop_with_parallel_replies(template_servers, force):
    """Five turns where the model writes two calls: each reply carries the first (parallel_tool_calls is
    true by default), so the history the client sends back always renders; streamed turns alike."""
    srv = template_servers(*LLAMA3)
    rt = srv.service.runtime
    assert srv.service.parsers.single_tool_call
    messages = list(ASK)
    for turn in range(5):
        if turn % 2:
            final, _, chunks = streamed(srv, messages, tools=TOOLS, seed=force(rt, TWO_CALLS))
            message, finish = final.choices[0].message, final.choices[0].finish_reason
            assert {tc.index for c in chunks for ch in c.choices for tc in ch.delta.tool_calls or []} == {0}
        else:
            resp = create(srv, messages, tools=TOOLS, seed=force(rt, TWO_CALLS))
            message, finish = resp.choices[0].message, resp.choices[0].finish_reason
        assert finish == "tool_calls" and len(message.tool_calls) == 1, turn
        call = message.tool_calls[0]
        assert call.function.name == "get_weather" and "Paris" in call.function.arguments
        messages += [
            {
                "role": "assistant",
                "content": message.content,
                "tool_calls": [
                    {
                        "id": call.id,
                        "type": "function",
                        "function": {"name": call.function.name, "arguments": call.function.arguments},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call.id, "content": f"sunny, turn {turn}"},
        ]
    last = create(srv, messages, tools=TOOLS, max_tokens=4)  # the sixth request renders all five calls
    assert last.choices[0].finish_reason in ("stop", "length", "tool_calls")

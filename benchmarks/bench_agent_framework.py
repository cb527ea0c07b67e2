"""An agent framework, unchanged, drives hyserve back to back: how much of each request's history is reused.

openai-agents (`pip install -e '.[agents]'`) runs a coding agent (`Agent` with `@function_tool` tools over
`OpenAIChatCompletionsModel`) against a hyserve server on loopback that loads the bench qwen3_5 model with
the real Qwen3.5 template. The framework sends the next request the instant a reply or a tool result is
ready, as agents do: no idle time. Each user turn is one `Runner.run` over the conversation so far; the agent
calls tools twice, then answers. Both habits of clients are run: openai-agents' default, which does not send
the model's reasoning back, and `should_replay_reasoning_content` set, which does.

A random-weight model never writes a tool call, so every reply is forced (`hyserve.testing.forced`): a transport
under the framework's HTTP client adds a scripted seed to each request (reasoning, `</think>`, the XML tool
call or an answer). Everything else runs as always. The transport also reads each request's messages and
each response's usage: per request, cached tokens against its history (the prompt tokens that do not depend
on its new trailing messages: `ModelRuntime.render_next_turn` of the messages up to the last reply).

    python benchmarks/bench_agent_framework.py --json benchmarks/results/agent-framework.json
    python benchmarks/bench_agent_framework.py --quick      # tiny model, 2 user turns
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common as C  # noqa: E402

TEMPLATE = C.QWEN35_TEMPLATE
CALLS_PER_TURN = 2


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny model, 2 user turns (< 1 minute)")
    p.add_argument("--turns", type=int, default=None, help="user turns per conversation (default 4; quick 2)")
    p.add_argument("--result-tokens", type=int, default=None, help="tokens per tool result (default 300; quick 60)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default=None, help="write the results here")
    return p.parse_args(argv)


class Recorder(httpx.AsyncBaseTransport):
    """Under the framework's client: gives each chat request its forced reply (a seed) and records what was
    sent and what came back."""

    def __init__(self, inner: httpx.AsyncBaseTransport, script):
        self.inner, self.script, self.rows = inner, script, []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if not request.url.path.endswith("/chat/completions"):
            return await self.inner.handle_async_request(request)
        body = json.loads(request.content)
        body["seed"] = self.script(body["messages"])
        request = httpx.Request(
            request.method,
            request.url,
            headers={k: v for k, v in request.headers.items() if k.lower() != "content-length"},
            json=body,
        )
        t0 = time.perf_counter()
        response = await self.inner.handle_async_request(request)
        content = await response.aread()
        usage = json.loads(content)["usage"]
        self.rows.append(
            {
                "messages": body["messages"],
                "tools": body.get("tools"),
                "prompt_tokens": usage["prompt_tokens"],
                "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
                "seconds": time.perf_counter() - t0,
            }
        )
        return httpx.Response(response.status_code, headers=response.headers, content=content)


def forced_script(forced, tok, rng: random.Random):
    """messages -> the seed of the reply this request is forced to: a tool call while the current user turn
    has had fewer than CALLS_PER_TURN tool results, else an answer."""
    from bench_agent import TOOLS, tool_call_text

    def script(messages: list[dict]) -> int:
        since_user = 0
        for m in reversed(messages):
            if m["role"] == "user":
                break
            since_user += m["role"] == "tool"
        step = sum(m["role"] == "tool" for m in messages)
        if since_user < CALLS_PER_TURN:
            return forced.seed_for(tok, tool_call_text(rng, step))
        return forced.seed_for(tok, f"All {len(TOOLS)} tools were enough.\n</think>\n\n" + C.prose(rng, 30))

    return script


async def drive(base: str, tok, rng: random.Random, turns: int, result_tokens: int, replays: bool, forced):
    """One conversation of `turns` user turns through openai-agents; the recorder's rows."""
    from agents import Agent, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    result_text = C.text_of_tokens(tok, rng, result_tokens)

    @function_tool
    def read_file(path: str) -> str:
        """Read a file of the repository."""
        return f"{path}: {result_text}"

    @function_tool
    def search_code(pattern: str, glob: str) -> str:
        """Search the repository for a pattern."""
        return f"{pattern} in {glob}: {result_text}"

    @function_tool
    def run_tests(selector: str) -> str:
        """Run the test suite, or some of it."""
        return f"{selector}: {result_text}"

    @function_tool
    def edit_file(path: str, old: str, new: str) -> str:
        """Replace a span of a file."""
        return f"edited {path}"

    recorder = Recorder(httpx.AsyncHTTPTransport(), forced_script(forced, tok, rng))
    client = AsyncOpenAI(
        base_url=f"{base}/v1",
        api_key="unused",
        max_retries=0,
        http_client=httpx.AsyncClient(transport=recorder, timeout=600),
    )
    model = OpenAIChatCompletionsModel(
        model="agent", openai_client=client, should_replay_reasoning_content=(lambda ctx: True) if replays else None
    )
    agent = Agent(
        name="coder",
        model=model,
        tools=[read_file, search_code, run_tests, edit_file],
        instructions="You are a coding agent working in a Python repository. " + C.prose(rng, 120),
    )
    items: list = []
    for turn in range(turns):
        items.append({"role": "user", "content": f"Turn {turn + 1}: " + C.prose(rng, 25)})
        result = await Runner.run(agent, items, max_turns=CALLS_PER_TURN + 2)
        items = result.to_input_list()
    await client.close()
    return recorder.rows


def histories(rt, rows: list[dict]) -> None:
    """Each row's history: its messages up to the last assistant message, as the template renders them with
    the request's tools."""
    from hyserve.chat import template_message

    for row in rows:
        messages, tools = row.pop("messages"), row.pop("tools")
        last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None)
        row["history_tokens"] = (
            0
            if last is None
            else len(
                rt.render_next_turn(
                    [template_message(m) for m in messages[: last + 1]],
                    template_kwargs={"tools": tools} if tools else None,
                )
            )
        )
        row["after"] = messages[-1]["role"]


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        import agents  # noqa: F401
    except ImportError:
        print("openai-agents is not installed: pip install -e '.[agents]'", file=sys.stderr)
        return 2
    if not TEMPLATE.is_file():
        print(f"the real Qwen3.5 template is not at {TEMPLATE}", file=sys.stderr)
        return 2
    C.setup_torch(args.threads)
    size = "tiny" if args.quick else "bench"
    turns = args.turns or (2 if args.quick else 4)
    result_tokens = args.result_tokens or (60 if args.quick else 300)
    model_dir = C.ensure_model("qwen3_5", size, TEMPLATE)
    from hyserve.server.run import BackgroundServer
    from hyserve.service import ServiceConfig, build_service
    from hyserve.testing.forced import ForcedReplies

    svc = build_service(
        ServiceConfig(model_dir=model_dir, served_model_name="agent", device="cpu", cache_bytes=2 << 30)
    )
    forced = ForcedReplies(8_000_000).attach(svc.engine)
    runs = {}
    try:
        with BackgroundServer(svc) as srv:
            for habit, replays in (("reasoning dropped (default)", False), ("reasoning sent back", True)):
                rows = asyncio.run(
                    drive(
                        srv.base_url,
                        svc.runtime.tokenizer,
                        random.Random(len(runs)),
                        turns,
                        result_tokens,
                        replays,
                        forced,
                    )
                )
                histories(svc.runtime, rows)
                runs[habit] = rows
    finally:
        svc.engine.stop()
    result = {"args": vars(args), "runs": runs}
    print(table(result))
    if args.json:
        C.write_result(args.json, "bench_agent_framework.py", result)
    later = [r for rows in runs.values() for r in rows if r["history_tokens"]]
    return 0 if later else 1


def ratios(rows: list[dict]) -> list[float]:
    return [r["cached_tokens"] / r["history_tokens"] for r in rows if r["history_tokens"]]


def table(result: dict) -> str:
    out = []
    for habit, rows in result["runs"].items():
        rs = ratios(rows)
        out.append(
            [
                habit,
                len(rows),
                sum(r["prompt_tokens"] for r in rows),
                sum(r["cached_tokens"] for r in rows),
                C.fmt_ratio(min(rs), 3) if rs else "-",
                C.fmt_ratio(C.mean(rs), 3) if rs else "-",
                sum(r < 0.98 for r in rs),
            ]
        )
    return C.table(
        [
            "client habit",
            "requests",
            "prompt tokens",
            "cached tokens",
            "min cached/history",
            "mean cached/history",
            "requests under 0.98",
        ],
        out,
    )


if __name__ == "__main__":
    sys.exit(main())

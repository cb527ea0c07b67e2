"""An agent workload on the real Qwen3.5 chat template: how much of each turn's history the cache serves.

One conversation of `--turns` requests: a system prompt, tool definitions, then rounds of a user request,
an assistant turn that reasons and calls a tool, the tool's result (a few hundred tokens), and an
assistant answer. It is sent turn by turn to two hyserve servers on loopback that load the same bench
qwen3_5 model with the real Qwen3.5 template (`../shared/fixtures/chat_templates/Qwen3.5-4B.jinja`; the
bench tokenizer gets its control tokens): one with the prefix cache on, one with it off. Both servers run
in this process (the forced replies below need it), one request at a time.

A random-weight model never writes a tool call, so the tool-calling turns are forced: for a request that
carries a scripted seed, sampling returns the script's tokens (reasoning, `</think>`, the XML tool call),
then end of turn. Everything else runs as always: the prompt is rendered with the tools and the history's
tool calls and results, the prefill restores from the cache, every forced token runs through the model,
and the reply is parsed into reasoning and tool calls and sent back by the client as an agent would.
Answer turns are the model's own greedy replies (reasoning that never closes, so an empty answer).

Per turn: prompt tokens, cached tokens, the history (the previous request's messages and reply, as this
turn renders them: `ModelRuntime.render_next_turn`), cached/history, and time to first token (first
streamed chunk) with the cache on and off. With `--back-to-back` the next request goes out the moment a
reply ends (no idle time for the engine's idle-time checkpoints).

    python benchmarks/bench_agent.py --json benchmarks/results/agent.json        # 12 turns, ~4-5k tokens
    python benchmarks/bench_agent.py --back-to-back --json benchmarks/results/agent-back-to-back.json
    python benchmarks/bench_agent.py --quick                                      # tiny model, 6 turns
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common as C  # noqa: E402

TEMPLATE = C.QWEN35_TEMPLATE
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": desc,
            "parameters": {
                "type": "object",
                "properties": {p: {"type": "string", "description": f"the {p}"} for p in ps},
                "required": list(ps),
            },
        },
    }
    for name, desc, ps in [
        ("read_file", "Read a file of the repository", ("path",)),
        ("search_code", "Search the repository for a pattern", ("pattern", "glob")),
        ("run_tests", "Run the test suite, or some of it", ("selector",)),
        ("edit_file", "Replace a span of a file", ("path", "old", "new")),
    ]
]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny model, 6 turns (< 1 minute)")
    p.add_argument("--turns", type=int, default=None, help="requests in the conversation (default 12; quick 6)")
    p.add_argument("--result-tokens", type=int, default=None, help="tokens per tool result (default 300; quick 60)")
    p.add_argument("--max-tokens", type=int, default=24, help="length of the model's own answers")
    p.add_argument("--back-to-back", action="store_true", help="no idle time between turns")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default=None, help="write the results here")
    return p.parse_args(argv)


def build_model(size: str) -> Path:
    return C.ensure_model("qwen3_5", size, TEMPLATE)


def tool_call_text(rng: random.Random, round_: int) -> str:
    tool = TOOLS[round_ % len(TOOLS)]["function"]
    params = "".join(
        f"<parameter={p}>\n{rng.choice(['src/app.py', 'tests/', 'def main', '*.py', 'x = 1'])}\n</parameter>\n"
        for p in tool["parameters"]["properties"]
    )
    return (
        f"I should look at the code before answering; step {round_}.\n</think>\n\n"
        f"<tool_call>\n<function={tool['name']}>\n{params}</function>\n</tool_call>"
    )


def stream_turn(base: str, body: dict) -> tuple[dict, float]:
    """Send one streamed chat request; (the reply as the client sends it back, usage, token ids) and TTFT."""
    t0, ttft = time.perf_counter(), None
    reasoning, content, calls, usage, ids = [], [], {}, None, []
    with httpx.stream(
        "POST",
        f"{base}/v1/chat/completions",
        json={**body, "stream": True, "return_token_ids": True, "stream_options": {"include_usage": True}},
        timeout=600,
    ) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", []):
                delta = choice.get("delta", {})
                ids += choice.get("token_ids") or []
                if ttft is None and (
                    delta.get("content")
                    or delta.get("reasoning_content")
                    or delta.get("tool_calls")
                    or choice.get("token_ids")
                ):
                    ttft = time.perf_counter() - t0
                reasoning.append(delta.get("reasoning_content") or "")
                content.append(delta.get("content") or "")
                for call in delta.get("tool_calls") or []:
                    slot = calls.setdefault(
                        call["index"], {"id": None, "type": "function", "function": {"name": "", "arguments": ""}}
                    )
                    slot["id"] = call.get("id") or slot["id"]
                    fn = call.get("function") or {}
                    slot["function"]["name"] += fn.get("name") or ""
                    slot["function"]["arguments"] += fn.get("arguments") or ""
    message = {"role": "assistant", "content": "".join(content)}
    if "".join(reasoning):
        message["reasoning_content"] = "".join(reasoning)
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return {"message": message, "usage": usage, "ids": ids}, ttft


def wait_idle(base: str, limit: float = 120.0) -> None:
    deadline = time.monotonic() + limit
    while not httpx.get(f"{base}/health").json().get("idle", True) and time.monotonic() < deadline:
        time.sleep(0.01)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not TEMPLATE.is_file():
        print(f"the real Qwen3.5 template is not at {TEMPLATE}", file=sys.stderr)
        return 2
    C.setup_torch(args.threads)
    size = "tiny" if args.quick else "bench"
    turns = args.turns or (6 if args.quick else 12)
    result_tokens = args.result_tokens or (60 if args.quick else 300)
    model_dir = build_model(size)
    from hyserve.testing.forced import ForcedReplies

    forced = ForcedReplies(7_000_000)

    from hyserve.chat import template_message
    from hyserve.server.run import BackgroundServer
    from hyserve.service import ServiceConfig, build_service

    services = {
        name: build_service(
            ServiceConfig(
                model_dir=model_dir,
                served_model_name="agent",
                device="cpu",
                cache_enabled=(name == "on"),
                cache_bytes=2 << 30,
            )
        )
        for name in ("on", "off")
    }
    for svc in services.values():
        forced.attach(svc.engine)
    rt = services["on"].runtime
    tok = rt.tokenizer
    rng = random.Random(0)
    system = "You are a coding agent working in a Python repository. " + C.text_of_tokens(
        tok, rng, 250 if not args.quick else 60
    )
    messages = [
        {"role": "system", "content": system},
        {"role": "user", "content": "The tests fail after the last change. " + C.prose(rng, 30)},
    ]
    rows, previous = [], None
    servers = {name: BackgroundServer(svc).__enter__() for name, svc in services.items()}
    try:
        for turn in range(1, turns + 1):
            calls_tool = messages[-1]["role"] == "user"  # a user request: the agent reasons and calls a tool
            body = {
                "model": "agent",
                "messages": messages,
                "tools": TOOLS,
                "temperature": 0,
                "max_tokens": 400 if calls_tool else args.max_tokens,
            }
            if calls_tool:
                body["seed"] = forced.seed_for(tok, tool_call_text(rng, turn))
            history = (
                len(rt.render_next_turn([template_message(m) for m in previous], template_kwargs={"tools": TOOLS}))
                if previous
                else 0
            )
            got = {}
            for name, srv in servers.items():
                got[name] = stream_turn(srv.base_url, body)
            (on, ttft_on), (off, ttft_off) = got["on"], got["off"]
            usage = on["usage"]
            cached = usage["prompt_tokens_details"]["cached_tokens"]
            rows.append(
                {
                    "turn": turn,
                    "kind": "tool call" if calls_tool else "answer",
                    "prompt_tokens": usage["prompt_tokens"],
                    "cached_tokens": cached,
                    "history_tokens": history,
                    "cached_over_history": (cached / history) if history else None,
                    "ttft_on_s": ttft_on,
                    "ttft_off_s": ttft_off,
                    "same_reply": on["ids"] == off["ids"],
                }
            )
            print(
                f"turn {turn:2d} {rows[-1]['kind']:9s} prompt {usage['prompt_tokens']:5d} cached {cached:5d} "
                f"history {history:5d} ttft on {ttft_on:.3f} s off {ttft_off:.3f} s same {rows[-1]['same_reply']}",
                file=sys.stderr,
                flush=True,
            )
            reply = on["message"]
            messages = messages + [reply]
            previous = list(messages)
            if reply.get("tool_calls"):
                for call in reply["tool_calls"]:
                    messages.append(
                        {
                            "role": "tool",
                            "tool_call_id": call["id"],
                            "content": C.text_of_tokens(tok, rng, result_tokens),
                        }
                    )
            else:
                messages.append({"role": "user", "content": "Good. Next: " + C.prose(rng, 25)})
            if not args.back_to_back:
                for srv in servers.values():
                    wait_idle(srv.base_url)
    finally:
        for srv in servers.values():
            srv.__exit__(None, None, None)
        for svc in services.values():
            svc.engine.stop()
    result = {"machine": C.machine_info(), "args": vars(args), "rows": rows}
    print(table(result))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1))
    later = [r for r in rows if r["history_tokens"]]
    ok = all(r["same_reply"] for r in rows) and (
        args.back_to_back or all(r["cached_over_history"] >= 0.99 for r in later)
    )
    return 0 if ok else 1


def table(result: dict) -> str:
    rows = result["rows"]
    return C.table(
        [
            "turn",
            "kind",
            "prompt",
            "cached",
            "history",
            "cached/history",
            "TTFT on (s)",
            "TTFT off (s)",
            "off/on",
            "same reply",
        ],
        [
            [
                r["turn"],
                r["kind"],
                r["prompt_tokens"],
                r["cached_tokens"],
                r["history_tokens"],
                C.fmt_ratio(r["cached_over_history"], 3) if r["cached_over_history"] is not None else "-",
                C.fmt_s(r["ttft_on_s"]),
                C.fmt_s(r["ttft_off_s"]),
                C.fmt_ratio(r["ttft_off_s"] / r["ttft_on_s"]),
                "yes" if r["same_reply"] else "NO",
            ]
            for r in rows
        ],
    )


if __name__ == "__main__":
    sys.exit(main())

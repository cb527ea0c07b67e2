"""Command line: `hyserve serve`, `hyserve make-tiny-model`, `hyserve demo`, `hyserve env`."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from .cache.policy import CheckpointPolicy


def _add_serve_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (CUDA when available)")
    p.add_argument("--no-cache", action="store_true", help="disable the exact-state prefix cache")
    p.add_argument("--cache-bytes", type=int, default=None, help="prefix-cache byte budget (default: 25%% of RAM)")
    p.add_argument("--no-history-checkpoint", action="store_true")
    p.add_argument("--no-system-checkpoint", action="store_true")
    p.add_argument("--no-post-decode-checkpoint", action="store_true")
    p.add_argument("--no-defer-checkpoints", action="store_true",
                   help="always split the prefill at a checkpoint boundary, even a few tokens before the end "
                        "(default: an idle engine records such a checkpoint after the reply, in idle time)")
    p.add_argument("--block-size", type=int, default=None,
                   help="baseline: keep recurrent checkpoints only every N tokens (vLLM-style block grid)")
    p.add_argument("--log-cache-events", default=None, metavar="PATH", help="append cache events as JSON lines")
    p.add_argument("--prefill-chunk", type=int, default=512)
    p.add_argument("--speculative", choices=["off", "prompt-lookup"], default="off",
                   help="prompt-lookup speculative decoding (used for greedy requests)")
    p.add_argument("--spec-tokens", type=int, default=6, help="proposals per verify pass (k)")
    p.add_argument("--spec-ngram", type=int, default=3, help="suffix length that must recur in the context (n)")
    p.add_argument("--max-running", type=int, default=8, help="requests decoded together (batch size)")
    p.add_argument("--max-waiting", type=int, default=64, help="queued requests before answering 429")
    p.add_argument("--request-timeout", type=float, default=None, help="seconds before a request is ended")
    p.add_argument("--api-key", default=os.environ.get("HYSERVE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 (comma-separated for several tenants; "
                        "env HYSERVE_API_KEY)")
    p.add_argument("--admin-api-key", default=os.environ.get("HYSERVE_ADMIN_API_KEY"),
                   help="a key that sees and clears every tenant's cache at /v1/cache (env HYSERVE_ADMIN_API_KEY); "
                        "other keys act on their own tenant's entries")
    p.add_argument("--max-body-bytes", type=int, default=8 << 20)
    p.add_argument("--max-tokens-cap", type=int, default=None, help="largest max_tokens a request may ask for")
    p.add_argument("--max-messages", type=int, default=2048)
    p.add_argument("--allow-special-tokens-in-content", action="store_true",
                   help="tokenize special-token strings typed in message content (<|im_start|>, ...) as control "
                        "tokens, as before; default: they stay text, so content cannot forge turns")
    p.add_argument("--tool-call-parser", default="auto", metavar="NAME",
                   help="how tool calls are read from replies: hermes (JSON in <tool_call>), qwen3_xml "
                        "(<tool_call><function=...>), llama3_json, none, or auto (from the chat template)")
    p.add_argument("--reasoning-parser", default="auto", metavar="NAME",
                   help="how reasoning is split from replies: think (<think>...</think>), none, or auto "
                        "(from the chat template)")
    p.add_argument("--graceful-shutdown", type=float, default=30.0,
                   help="seconds running requests get to finish after SIGTERM")


def service_config_from_args(args) -> "ServiceConfig":
    from .service import ServiceConfig, default_cache_bytes
    from .speculative import SpeculativeConfig

    policy = CheckpointPolicy(
        history_boundary=not args.no_history_checkpoint,
        system_prompt=not args.no_system_checkpoint,
        post_decode=not args.no_post_decode_checkpoint,
        block_size=args.block_size,
        defer_tail=0 if args.no_defer_checkpoints else CheckpointPolicy.defer_tail,
    )
    return ServiceConfig(
        model_dir=Path(args.model_dir), served_model_name=args.served_model_name, dtype=args.dtype,
        device=args.device, cache_enabled=not args.no_cache,
        cache_bytes=args.cache_bytes if args.cache_bytes is not None else default_cache_bytes(),
        policy=policy, log_cache_events=args.log_cache_events, prefill_chunk=args.prefill_chunk,
        speculative=SpeculativeConfig(args.spec_tokens, args.spec_ngram) if args.speculative != "off" else None,
        max_running=args.max_running, max_waiting=args.max_waiting, request_timeout=args.request_timeout,
        api_keys=tuple(k.strip() for k in (args.api_key or "").split(",") if k.strip()),
        admin_api_key=(args.admin_api_key or "").strip() or None,
        max_body_bytes=args.max_body_bytes, max_tokens_cap=args.max_tokens_cap, max_messages=args.max_messages,
        allow_special_tokens_in_content=args.allow_special_tokens_in_content,
        tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser,
    )


def cmd_serve(args) -> int:
    from .runtime import UnsupportedModelError
    from .server.run import serve_forever
    from .service import build_service

    try:
        service = build_service(service_config_from_args(args))
    except (UnsupportedModelError, FileNotFoundError, ValueError) as exc:
        print(f"hyserve: cannot load model: {exc}", file=sys.stderr)
        return 2
    print(f"hyserve: serving {service.model_name} ({service.runtime.model.config.model_type}) "
          f"on http://{args.host}:{args.port}/v1", file=sys.stderr)
    serve_forever(service, args.host, args.port, args.graceful_shutdown)
    return 0


def cmd_make_tiny_model(args) -> int:
    from .tiny import make_tiny_model

    out = make_tiny_model(args.out_dir, args.arch, size=args.size, seed=args.seed, chat_template=args.chat_template)
    print(f"wrote a random-init {args.arch} ({args.size}) model to {out}")
    return 0


def cmd_demo(args) -> int:
    from .demo import run_demo

    return run_demo(arch=args.arch, cache_dir=args.cache_dir)


def cmd_env(args) -> int:
    from .env import report

    print(report(args.model_dir, args.dtype))
    return 0


def main(argv: list[str] | None = None) -> int:
    from .tiny import ARCHS

    parser = argparse.ArgumentParser(prog="hyserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("serve", help="serve a Hugging Face model directory over the OpenAI API")
    p.add_argument("model_dir")
    _add_serve_options(p)
    p.set_defaults(func=cmd_serve)
    p = sub.add_parser("make-tiny-model", help="write a small random-init model + tokenizer")
    p.add_argument("out_dir")
    p.add_argument("--arch", default="qwen3_5", choices=ARCHS)
    p.add_argument("--size", default="tiny", choices=["tiny", "bench"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chat-template", default=None, metavar="PATH",
                   help="a real model's chat template (.jinja) instead of ChatML; its control tokens are added")
    p.set_defaults(func=cmd_make_tiny_model)
    p = sub.add_parser("demo", help="build a tiny model, serve it, chat two turns through the openai client")
    p.add_argument("--arch", default="qwen3_5", choices=ARCHS)
    p.add_argument("--cache-dir", default=None)
    p.set_defaults(func=cmd_demo)
    p = sub.add_parser("env", help="print the versions hyserve runs on and, for a model, its kernels' load-time check")
    p.add_argument("model_dir", nargs="?", default=None)
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.set_defaults(func=cmd_env)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())

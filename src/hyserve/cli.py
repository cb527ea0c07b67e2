"""hyserve: an OpenAI-compatible server for hybrid recurrent/attention models whose exact-state prefix
cache makes chat turn N+1 cost only its new tokens. Commands: serve, make-tiny-model, demo, env."""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from .cache.policy import DEFER_TAIL, CheckpointPolicy

if TYPE_CHECKING:
    from .service import ServiceConfig

log = logging.getLogger("hyserve")


_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int:
    """Bytes from `8G`, `512M`, `1.5GiB`, `64KB` or a plain number; K/M/G/T are powers of 1024."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*", text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 8G, 512M, 1073741824)")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def _add_serve_options(parser: argparse.ArgumentParser) -> None:
    """serve's options in argparse groups: `--help` and docs/configuration.md show them by what they set."""
    p = parser.add_argument_group("listening")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on; taken before the model loads")
    p.add_argument(
        "--served-model-name", default=None, help="the name clients pass as `model` (default: the folder's name)"
    )
    p = parser.add_argument_group("model")
    p.add_argument(
        "--dtype", default="float32", choices=["float32", "float16", "bfloat16"], help="weights and activations"
    )
    p.add_argument(
        "--quantization",
        default=None,
        choices=["int8", "int4", "w8a8", "w4a8"],
        help="hold the weights as int8 or int4 (GGUF Q8_0 / Q4_0 blocks: 32 weights, one scale; the head "
        "Q8_0, w4a8's 6-bit Q6_0), made at load from the folder's weights; int8/int4 keep the activations in "
        "--dtype, w8a8/w4a8 round each product's input to Q8_0 blocks and multiply in integers, as llama.cpp "
        "does (faster at 4 bits); CPU only",
    )
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (CUDA when available)")
    p = parser.add_argument_group("prefix cache")
    p.add_argument("--no-cache", action="store_true", help="disable the exact-state prefix cache")
    p.add_argument(
        "--cache-bytes",
        type=parse_size,
        default=None,
        metavar="SIZE",
        help="prefix-cache byte budget: 8G, 512M or bytes, K/M/G/T powers of 1024 (default: 25%% of RAM; "
        "on a GPU, where snapshots stay, half of the GPU memory the model leaves free)",
    )
    p.add_argument(
        "--cache-dir",
        default=None,
        metavar="DIR",
        help="a disk tier for the prefix cache: checkpoints evicted from memory and history "
        "boundaries are written here, and found again after a restart (same model and template)",
    )
    p.add_argument(
        "--cache-disk-bytes",
        type=parse_size,
        default=16 << 30,
        metavar="SIZE",
        help="byte budget of --cache-dir, least recently used files deleted first (default: 16G)",
    )
    p.add_argument(
        "--no-kv-sharing",
        action="store_true",
        help="store each checkpoint's whole attention KV, instead of only the KV of the tokens since "
        "the checkpoint above it on the same conversation path (more memory, same output)",
    )
    p.add_argument(
        "--no-history-checkpoint",
        action="store_true",
        help="do not checkpoint at the message-history boundary (what the next turn reuses)",
    )
    p.add_argument(
        "--no-system-checkpoint",
        action="store_true",
        help="do not checkpoint at the end of the system prompt (what new chats share)",
    )
    p.add_argument(
        "--no-post-decode-checkpoint",
        action="store_true",
        help="do not checkpoint after the reply (prompt + generated tokens)",
    )
    p.add_argument(
        "--defer-checkpoints",
        action="store_true",
        help="leave a checkpoint a few tokens before the prompt's end to a job after the reply instead "
        "of splitting the prefill there (models that cannot capture states mid-pass: mamba2, ...); "
        "the next turn then waits for that job",
    )
    p.add_argument(
        "--block-size",
        type=int,
        default=None,
        help="baseline: keep recurrent checkpoints only every N tokens (vLLM-style block grid)",
    )
    p.add_argument("--log-cache-events", default=None, metavar="PATH", help="append one JSON line per cache decision")
    p = parser.add_argument_group("scheduling")
    p.add_argument(
        "--prefill-chunk",
        type=int,
        default=512,
        help="prompt tokens per engine step: a long prompt delays other streams by about this much",
    )
    p.add_argument(
        "--speculative",
        choices=["off", "prompt-lookup"],
        default="off",
        help="prompt-lookup speculative decoding (used for greedy requests)",
    )
    p.add_argument("--spec-tokens", type=int, default=6, help="proposals per verify pass (k)")
    p.add_argument("--spec-ngram", type=int, default=3, help="suffix length that must recur in the context (n)")
    p.add_argument("--max-running", type=int, default=8, help="requests decoded together (batch size)")
    p.add_argument("--max-waiting", type=int, default=64, help="queued requests before answering 429")
    p.add_argument(
        "--request-timeout",
        type=float,
        default=None,
        help="seconds before a request is ended with 408 (default: no limit)",
    )
    p = parser.add_argument_group("access and limits")
    p.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1 (comma-separated for several tenants; "
        "default: env HYSERVE_API_KEY, else no key)",
    )
    p.add_argument(
        "--admin-api-key",
        default=None,
        help="a key that sees and clears every tenant's cache at /v1/cache (default: env "
        "HYSERVE_ADMIN_API_KEY); other keys act on their own tenant's entries",
    )
    p.add_argument(
        "--max-body-bytes",
        type=parse_size,
        default="8M",
        metavar="SIZE",
        help="largest request body, e.g. 8M; larger ones get 413",
    )
    p.add_argument(
        "--max-tokens-cap",
        type=int,
        default=None,
        help="largest max_tokens a request may ask for (default: the context left)",
    )
    p.add_argument("--max-messages", type=int, default=2048, help="most messages in one chat request")
    p.add_argument(
        "--response-store-bytes",
        type=parse_size,
        default=64 << 20,
        metavar="SIZE",
        help="byte budget of /v1/responses' stored responses, all tenants together (default: 64M)",
    )
    p.add_argument(
        "--allow-special-tokens-in-content",
        action="store_true",
        help="tokenize special-token strings typed in message content (<|im_start|>, ...) as control "
        "tokens, as before; otherwise they stay text, so content cannot forge turns",
    )
    p = parser.add_argument_group("replies")
    p.add_argument(
        "--tool-call-parser",
        default="auto",
        metavar="NAME",
        help="how tool calls are read from replies: hermes (JSON in <tool_call>), qwen3_xml "
        "(<tool_call><function=...>), llama3_json, none, or auto (from the chat template)",
    )
    p.add_argument(
        "--reasoning-parser",
        default="auto",
        metavar="NAME",
        help="how reasoning is split from replies: think (<think>...</think>), none, or auto (from the chat template)",
    )
    p = parser.add_argument_group("process")
    p.add_argument(
        "--graceful-shutdown",
        type=float,
        default=30.0,
        help="seconds running requests get to finish after the first Ctrl-C or SIGTERM; a second one exits at once",
    )
    p.add_argument(
        "--log-stats-interval",
        type=float,
        default=10.0,
        help="seconds between engine lines (throughput, running/waiting, cache hit rate) while there is work; 0: none",
    )
    p = parser.add_argument_group("several replicas (Ray Serve)")
    p.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="engine replicas behind one endpoint, on Ray Serve (needs `pip install 'hyserve[ray]'`); "
        "each request goes to the replica holding the deepest exact checkpoint of its prompt",
    )
    p.add_argument(
        "--ray-address",
        default=None,
        metavar="ADDRESS",
        help="join this Ray cluster (e.g. auto, or ray://host:10001) instead of starting a local one; "
        "implies Ray Serve even with --replicas 1",
    )
    p.add_argument(
        "--replica-cpus",
        type=float,
        default=1.0,
        help="CPUs Ray reserves for each replica (its torch threads: this, rounded, at least 1)",
    )


def service_config_from_args(args) -> ServiceConfig:
    from .engine.speculative import SpeculativeConfig
    from .service import ServiceConfig

    policy = CheckpointPolicy(
        history_boundary=not args.no_history_checkpoint,
        system_prompt=not args.no_system_checkpoint,
        post_decode=not args.no_post_decode_checkpoint,
        block_size=args.block_size,
        defer_tail=DEFER_TAIL if args.defer_checkpoints else 0,
    )
    # keys come from the environment here, not as argparse defaults, so `--help` never prints them
    api_key = args.api_key if args.api_key is not None else os.environ.get("HYSERVE_API_KEY")
    admin_api_key = args.admin_api_key if args.admin_api_key is not None else os.environ.get("HYSERVE_ADMIN_API_KEY")
    return ServiceConfig(
        model_dir=Path(args.model_dir),
        served_model_name=args.served_model_name,
        dtype=args.dtype,
        quantization=args.quantization,
        device=args.device,
        cache_enabled=not args.no_cache,
        cache_bytes=args.cache_bytes,
        cache_dir=Path(args.cache_dir) if args.cache_dir else None,
        cache_disk_bytes=args.cache_disk_bytes,
        kv_sharing=not args.no_kv_sharing,
        policy=policy,
        log_cache_events=args.log_cache_events,
        prefill_chunk=args.prefill_chunk,
        speculative=SpeculativeConfig(args.spec_tokens, args.spec_ngram) if args.speculative != "off" else None,
        max_running=args.max_running,
        max_waiting=args.max_waiting,
        request_timeout=args.request_timeout,
        api_keys=tuple(k.strip() for k in (api_key or "").split(",") if k.strip()),
        admin_api_key=(admin_api_key or "").strip() or None,
        max_body_bytes=args.max_body_bytes,
        max_tokens_cap=args.max_tokens_cap,
        max_messages=args.max_messages,
        response_store_bytes=args.response_store_bytes,
        allow_special_tokens_in_content=args.allow_special_tokens_in_content,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
    )


def cmd_serve(args) -> int:
    """Check everything that can be checked cheaply, take the port, then load the weights and serve."""
    from .gguf import is_gguf
    from .models.preflight import StartupError, bind, check_device, check_model_dir

    try:
        for warning in check_model_dir(args.model_dir):
            log.warning("%s", warning)
        check_device(args.device)
        sock = bind(args.host, args.port)
    except StartupError as exc:
        log.error("cannot start: %s", exc)
        return 2
    if args.replicas < 1:
        log.error("cannot start: --replicas must be at least 1")
        return 2
    if (args.replicas > 1 or args.ray_address) and is_gguf(args.model_dir):  # its router reads HF folders only
        log.error("cannot start: --replicas and --ray-address serve Hugging Face folders only, not a GGUF file yet")
        sock.close()
        return 2
    if args.replicas > 1 or args.ray_address:
        sock.close()  # Ray Serve's proxy takes the port itself
        return _serve_on_ray(args)
    service = _load(args)
    if service is None:
        sock.close()
        return 2
    from .server.run import serve_forever
    from .stats_log import StatsLogger

    with StatsLogger(service, args.log_stats_interval):
        serve_forever(service, sock, args.graceful_shutdown)
    return 0


def _serve_on_ray(args) -> int:
    try:
        import ray  # noqa: F401
        from ray import serve  # noqa: F401
    except ImportError:
        log.error("cannot start: --replicas needs Ray Serve: pip install 'hyserve[ray]'")
        return 2
    from .scale.launch import serve_replicas

    return serve_replicas(
        service_config_from_args(args),
        args.replicas,
        args.host,
        args.port,
        args.ray_address,
        args.replica_cpus,
        max(1, round(args.replica_cpus)),
    )


def _load(args):
    """The service, or None after saying why it could not be built (a Ctrl-C meanwhile: see `main`)."""
    from .service import build_service

    try:
        return build_service(service_config_from_args(args))
    except Exception as exc:  # a user's folder or machine, not a bug: one line, the traceback on demand
        log.error("cannot load model: %s: %s", type(exc).__name__, exc)
        log.debug("traceback", exc_info=True)
        if not log.isEnabledFor(logging.DEBUG):
            log.error("run with --log-level debug for the traceback")
        return None


def cmd_make_tiny_model(args) -> int:
    from .testing.tiny import FolderNotEmpty, default_arch, make_tiny_model

    try:
        out = make_tiny_model(
            args.out_dir, args.arch, size=args.size, seed=args.seed, force=args.force, chat_template=args.chat_template
        )
    except FolderNotEmpty as exc:
        log.error("%s", exc)
        return 2
    print(f"wrote a random-init {args.arch or default_arch(args.size)} ({args.size}) model to {out}")
    return 0


def cmd_demo(args) -> int:
    from .demo import run_demo

    return run_demo(arch=args.arch, cache_dir=args.cache_dir)


def cmd_env(args) -> int:
    from .env import report
    from .models.preflight import StartupError, check_model_dir

    try:
        if args.model_dir is not None:
            check_model_dir(args.model_dir)
    except StartupError as exc:
        log.error("cannot load model: %s", exc)
        return 2
    from .gguf import GGUFError

    try:
        print(report(args.model_dir, args.dtype, args.quantization))
    except GGUFError as exc:  # found only when loading: a tensor the family has no place for, ...
        log.error("cannot load model: %s", exc)
        return 2
    return 0


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults in every flag's help, except where they say nothing (None, False) or the help gives one."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False or "default:" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    from . import __version__
    from .logs import FORMATS, LEVELS
    from .testing.tiny import ARCHS, SIZES

    common = argparse.ArgumentParser(add_help=False)
    logging_options = common.add_argument_group("logging")
    logging_options.add_argument(
        "--log-level",
        default="info",
        choices=LEVELS,
        help="debug adds a line per prefill chunk and per /health and /metrics request",
    )
    logging_options.add_argument(
        "--log-format", default="text", choices=FORMATS, help="json: one JSON object per line, for log shippers"
    )
    parser = argparse.ArgumentParser(prog="hyserve", description=__doc__, formatter_class=_Help)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    def command(name: str, help: str, func) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help, parents=[common], formatter_class=_Help)
        p.set_defaults(func=func)
        return p

    p = command("serve", "serve a Hugging Face model folder or a GGUF file over the OpenAI API", cmd_serve)
    p.add_argument(
        "model_dir",
        help="a local Hugging Face model folder (config.json, *.safetensors, tokenizer), or a "
        ".gguf file (qwen35, qwen35moe, qwen3next, nemotron_h, granitehybrid, falcon-h1, mamba2 with Q8_0 / "
        "Q4_0 weights kept quantized; llama, qwen2, qwen3, lfm2 dequantized to --dtype; see docs/gguf.md)",
    )
    _add_serve_options(p)
    p = command(
        "make-tiny-model",
        "write a small random-init model + tokenizer (for tests and trying things)",
        cmd_make_tiny_model,
    )
    p.add_argument("out_dir", help="folder to write; must be empty or new unless --force")
    p.add_argument(
        "--arch", default=None, choices=ARCHS, help="model family (default: qwen3_5; for --size real-moe, qwen3_5_moe)"
    )
    p.add_argument(
        "--size",
        default="tiny",
        choices=SIZES,
        help="tiny: ~100k parameters for tests; bench: tens of millions, for benchmarks; real-0.8b: qwen3_5 at "
        "the real dimensions of a 0.75B model (~3 GB); real-moe: qwen3_5_moe with Qwen3.5-35B-A3B's "
        "layer (64 of its 256 experts, 4 of its 40 layers; 1.46B parameters, ~2.9 GB in bfloat16)",
    )
    p.add_argument("--seed", type=int, default=0, help="random-init seed")
    p.add_argument(
        "--chat-template",
        default=None,
        metavar="PATH",
        help="a real model's chat template (.jinja) instead of ChatML; its control tokens are added",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="write into a non-empty folder: replaces the files it writes, keeps every other file",
    )
    p = command("demo", "build a tiny model, serve it, chat two turns through the openai client", cmd_demo)
    p.add_argument("--arch", default="qwen3_5", choices=ARCHS, help="model family")
    p.add_argument("--cache-dir", default=None, help="where the tiny model is kept (default: ~/.cache/hyserve)")
    p = command("env", "print the versions hyserve runs on and, for a model, its kernels' load-time check", cmd_env)
    p.add_argument(
        "model_dir", nargs="?", default=None, help="a model folder or GGUF file to load on the CPU and check"
    )
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"], help="dtype to check")
    p.add_argument(
        "--quantization",
        default=None,
        choices=["int8", "int4", "w8a8", "w4a8"],
        help="quantize the weights at load, as serve",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    from .process_settings import apply

    apply()  # first: before anything imports torch (see process_settings)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:  # bare `hyserve`: what it can do
        parser.print_help()
        return 0
    from .logs import configure

    configure(args.log_level, args.log_format)
    try:
        return args.func(args)
    except KeyboardInterrupt:  # Ctrl-C outside the server's own handling (building a model, a check, ...)
        log.warning("interrupted")
        for handler in logging.getLogger().handlers:
            handler.flush()
        os._exit(130)  # the model thread may be inside torch: interpreter shutdown would wait or abort


if __name__ == "__main__":
    sys.exit(main())

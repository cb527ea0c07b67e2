"""Wire a model directory into a running engine: runtime, prefix cache, policy, metrics, telemetry."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from .cache.disk import DiskTier
from .cache.fingerprint import fingerprint
from .cache.manager import PrefixCache
from .cache.policy import CheckpointPolicy
from .cache.telemetry import CacheTelemetry
from .chat.call_limit import renders_parallel_calls
from .engine import Engine
from .engine.speculative import SpeculativeConfig
from .metrics import Metrics
from .models.runtime import ModelRuntime
from .parsers import Parsers, choose_parsers
from .parsers.registry import template_text


def default_cache_bytes(fraction: float = 0.25, device=None) -> int:
    """A quarter of physical RAM: room for many checkpoints while leaving the model and OS theirs. On a GPU,
    where snapshots stay (copies of the model's own state tensors), half of its memory still free once
    the model is loaded: host RAM says nothing of what fits there."""
    if device is not None and torch.device(device).type == "cuda":
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return free // 2
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * fraction)
    except (ValueError, OSError, AttributeError):
        return 4 << 30


@dataclass
class ServiceConfig:
    model_dir: Path
    served_model_name: str | None = None
    dtype: str = "float32"
    quantization: str | None = None  # a scheme of `quant.SCHEMES`: the weights held as int8, made at load
    device: str = "auto"
    cache_enabled: bool = True
    cache_bytes: int | None = None  # None: `default_cache_bytes` of the device the model is on
    cache_dir: Path | None = None  # the disk tier's directory; None: memory only
    kv_sharing: bool = True  # checkpoints along one path store their attention KV once (`hyserve.state.kv_chain`)
    cache_disk_bytes: int = 16 << 30
    policy: CheckpointPolicy = field(default_factory=CheckpointPolicy)
    log_cache_events: str | None = None
    prefill_chunk: int = 512
    speculative: SpeculativeConfig | None = None  # prompt-lookup speculation (greedy requests only)
    max_running: int = 8
    max_waiting: int = 64
    request_timeout: float | None = None  # seconds
    stall_timeout: float = 60.0  # seconds a step may run before the watchdog fails its requests (/health: degraded)
    api_keys: tuple[str, ...] = ()  # empty: no authentication
    admin_api_key: str | None = None  # sees and clears every tenant's cache; others act on their own
    max_body_bytes: int = 8 << 20
    max_tokens_cap: int | None = None
    max_messages: int = 2048
    response_store_bytes: int = 64 << 20  # /v1/responses `store: true`: all tenants' stored responses
    allow_special_tokens_in_content: bool = False  # True: `<|im_start|>` typed in a message is a control token
    tool_call_parser: str = "auto"  # a name in parsers.TOOL_PARSERS, "none", or "auto": from the chat template
    reasoning_parser: str = "auto"  # likewise, parsers.REASONING_PARSERS

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.model_dir).name


@dataclass
class Service:
    config: ServiceConfig
    runtime: ModelRuntime
    metrics: Metrics
    cache: PrefixCache
    engine: Engine
    parsers: Parsers = field(default_factory=lambda: Parsers(None, None))  # how chat replies are read
    draining: bool = False  # set on SIGTERM: running requests finish, new ones get 503
    inflight: int = 0  # HTTP requests being served (not /health, /metrics): draining waits for them

    @property
    def model_name(self) -> str:
        return self.config.model_name


def build_service(config: ServiceConfig) -> Service:
    """Raises ValueError for an unknown parser name (before the model is loaded)."""
    choose_parsers("", config.tool_call_parser, config.reasoning_parser)
    runtime = ModelRuntime.load(
        config.model_dir, dtype=config.dtype, device=config.device, quantization=config.quantization
    )
    parsers = choose_parsers(template_text(runtime.tokenizer), config.tool_call_parser, config.reasoning_parser)
    if parsers.tool is not None and not renders_parallel_calls(runtime.tokenizer):
        parsers = replace(parsers, single_tool_call=True)
    runtime.special_tokens_in_content = config.allow_special_tokens_in_content
    metrics = Metrics()
    for name, status in runtime.kernels.status.items():
        metrics.kernel_active.labels(name).set(1 if status == "on" else 0)
    telemetry = CacheTelemetry(metrics, config.log_cache_events)
    disk = None
    if config.cache_enabled and config.cache_dir is not None:
        disk = DiskTier(
            config.cache_dir,
            config.cache_disk_bytes,
            fingerprint(runtime, template_text(runtime.tokenizer)),
            metrics,
            telemetry,
        )
    budget = config.cache_bytes
    if budget is None:
        budget = default_cache_bytes(device=runtime.model.device)
    cache = PrefixCache(budget, metrics, telemetry, enabled=config.cache_enabled, disk=disk, share_kv=config.kv_sharing)
    engine = Engine(
        runtime,
        cache,
        config.policy,
        metrics,
        prefill_chunk=config.prefill_chunk,
        speculative=config.speculative,
        max_running=config.max_running,
        max_waiting=config.max_waiting,
        stall_timeout=config.stall_timeout,
    )
    return Service(config, runtime, metrics, cache, engine, parsers)

"""Start-up checks that run before any weight is read, so a mistake costs a second, not a model load:
the model folder (readable, a supported `model_type`, weights and a tokenizer present, a chat template or
a warning) or GGUF file (complete, a supported architecture), the device, and the listening socket, bound
here and handed to uvicorn."""

from __future__ import annotations

import errno
import json
import os
import socket
from pathlib import Path

from ..gguf import is_gguf
from ..model_files import TOKENIZER_FILES, WEIGHT_GLOBS


class StartupError(Exception):
    """A reason the server cannot start, worded for the person who typed the command."""


def read_model_type(model_dir: str | Path) -> str:
    """The folder's `config.json` model_type, if hyserve serves it. Raises FileNotFoundError (no config),
    ValueError (unreadable JSON) or UnsupportedModelError (with the supported list)."""
    from ..families import SUPPORTED_MODEL_TYPES, UnsupportedModelError

    config_path = Path(model_dir) / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{model_dir} has no config.json: not a Hugging Face model directory")
    try:
        model_type = json.loads(config_path.read_text()).get("model_type")
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{config_path} is not valid JSON: {exc}") from exc
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    return model_type


def has_chat_template(model_dir: Path) -> bool:
    """Where transformers looks for one: a file of its own, or a key in tokenizer_config.json."""
    if (model_dir / "chat_template.jinja").is_file() or (model_dir / "chat_template.json").is_file():
        return True
    if (model_dir / "additional_chat_templates").is_dir():
        return True
    try:
        return bool(json.loads((model_dir / "tokenizer_config.json").read_text()).get("chat_template"))
    except (OSError, ValueError):
        return False


def check_model_dir(model_dir: str | Path) -> list[str]:
    """Raise StartupError when the folder cannot be served; return warnings for what serves only in part."""
    path = Path(model_dir)
    if not path.exists():
        raise StartupError(f"model folder {path} does not exist")
    if is_gguf(path):
        return check_gguf(path)
    if not path.is_dir():
        raise StartupError(
            f"{path} is not a folder: pass a Hugging Face model folder (config.json, weights, "
            "tokenizer) or a .gguf file"
        )
    if not os.access(path, os.R_OK | os.X_OK):
        raise StartupError(f"model folder {path} is not readable by this user")
    try:
        read_model_type(path)
    except (FileNotFoundError, ValueError) as exc:  # UnsupportedModelError is a ValueError
        raise StartupError(str(exc)) from exc
    from ..quant.checkpoint import refusal

    if why := refusal(path):
        raise StartupError(why)
    weights = [f for pattern in WEIGHT_GLOBS for f in path.glob(pattern)]
    if not weights:
        raise StartupError(
            f"{path} has no weights (*.safetensors or pytorch_model*.bin); hyserve never downloads "
            "them: point it at a folder that holds them"
        )
    unreadable = [f.name for f in weights if not os.access(f, os.R_OK)]
    if unreadable:
        raise StartupError(f"weights in {path} not readable by this user: {', '.join(sorted(unreadable))}")
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise StartupError(f"{path} has no tokenizer (one of {', '.join(TOKENIZER_FILES)})")
    warnings = []
    if not has_chat_template(path):
        warnings.append(
            f"{path} has no chat template: /v1/chat/completions will answer 400, only /v1/completions "
            "(a raw prompt) works"
        )
    return warnings


def check_gguf(path: Path) -> list[str]:
    """A GGUF file (or a folder holding one): its header parsed and checked (`gguf.inspect`)."""
    from ..gguf import GGUFError, gguf_path, inspect

    try:
        if not os.access(gguf_path(path), os.R_OK):
            raise GGUFError(f"{gguf_path(path)} is not readable by this user")
        info = inspect(path)
    except GGUFError as exc:
        raise StartupError(str(exc)) from exc
    if not info.has_chat_template:
        return [
            f"{info.path} has no chat template in its metadata: /v1/chat/completions will answer 400, only "
            "/v1/completions (a raw prompt) works"
        ]
    return []


def check_device(device: str) -> None:
    """Refuse a device this torch build cannot use, with what to pass instead."""
    import torch

    if device in ("auto", "cpu"):
        return
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError) as exc:
        raise StartupError(f"--device {device}: not a device ({exc}); use auto, cpu, cuda or cuda:N") from exc
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            why = (
                "this torch is a CPU-only build"
                if torch.version.cuda is None
                else "no CUDA GPU is visible (check the driver and CUDA_VISIBLE_DEVICES)"
            )
            raise StartupError(
                f"--device {device}: CUDA is not available: {why} (torch {torch.__version__}); use --device cpu"
            )
        count = torch.cuda.device_count()
        if dev.index is not None and dev.index >= count:
            raise StartupError(f"--device {device}: only {count} CUDA device(s) visible (cuda:0 to cuda:{count - 1})")
    elif dev.type == "mps":
        if not torch.backends.mps.is_available():
            raise StartupError(f"--device {device}: MPS is not available on this machine; use --device cpu")
    elif dev.type != "cpu":
        raise StartupError(f"--device {device}: unsupported device type; use auto, cpu, cuda or cuda:N")


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on host:port, taken before the model loads: a second server on a busy port stops
    here, and no other process can take the port while the weights load (connections made meanwhile wait
    in the backlog and are answered once the server runs)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise StartupError(f"--host {host}: cannot resolve it ({exc.strerror})") from exc
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: restarts need not wait TIME_WAIT
    try:
        sock.bind(addr)
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise StartupError(
                f"port {port} on {host} is already in use (another server?): stop it or choose another --port"
            ) from exc
        if exc.errno == errno.EACCES:
            raise StartupError(
                f"no permission to listen on port {port} (ports below 1024 need privileges): choose another --port"
            ) from exc
        if exc.errno == errno.EADDRNOTAVAIL:
            raise StartupError(f"--host {host} is not an address of this machine") from exc
        raise StartupError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc
    return sock

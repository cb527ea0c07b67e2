"""Shared fixtures: tiny random-init models built once per session, services and real servers on them."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from hyserve import process_settings

process_settings.apply()  # before torch, as `hyserve serve` runs: huge pages, transformers offline

from hyserve.cache.policy import CheckpointPolicy  # noqa: E402
from hyserve.models.runtime import ModelRuntime  # noqa: E402
from hyserve.service import ServiceConfig, build_service  # noqa: E402
from hyserve.testing.tiny import ARCHS, make_tiny_model  # noqa: E402

FAMILIES = ("qwen3_5", "qwen3_next", "mamba2", "qwen3")
# The hybrid families of issue 21: parametrized into the tests that issue lists (tests/test_families.py).
HYBRIDS = tuple(a for a in ARCHS if a not in FAMILIES)

# Real chat templates (see its SOURCES.md), next to the project: tests that use them skip when it is absent.
TEMPLATES_DIR = Path(__file__).resolve().parents[1].parent / "shared" / "fixtures" / "chat_templates"
QWEN35_TEMPLATE = "Qwen3.5-4B.jinja"
QWEN3_TEMPLATE = "Qwen-Qwen3-0.6B.jinja"
LLAMA3_TEMPLATE = "meta-llama-Llama-3.1-8B-Instruct.jinja"


def real_template(name: str) -> Path:
    path = TEMPLATES_DIR / name
    if not path.is_file():
        pytest.skip(f"real chat template {name} not found in {TEMPLATES_DIR}")
    return path


def wait_idle(service, timeout: float = 30) -> None:
    """Wait until the engine has no request and no idle-time job left (deferred checkpoints, rebuilds), as
    when a user reads a reply before sending the next turn."""
    deadline = time.time() + timeout
    while not service.engine.idle:
        assert time.time() < deadline, "engine did not become idle"
        time.sleep(0.01)


class _ModelDirs(dict):
    """Tiny model directories, each built the first time a test asks for it."""

    def __init__(self, root):
        super().__init__()
        self.root = root

    def __missing__(self, arch):
        self[arch] = make_tiny_model(self.root / arch, arch)
        return self[arch]


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory):
    return _ModelDirs(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="session")
def template_model_dirs(tmp_path_factory):
    """get(arch, template file name): a tiny model of `arch` with that real template (built once), or a skip."""
    built: dict[tuple[str, str], Path] = {}

    def get(arch: str, template: str) -> Path:
        if (arch, template) not in built:
            path = real_template(template)
            built[arch, template] = make_tiny_model(
                tmp_path_factory.mktemp(f"{arch}-template"), arch, chat_template=path
            )
        return built[arch, template]

    return get


@pytest.fixture(scope="session")
def runtimes(model_dirs):
    cache: dict[str, ModelRuntime] = {}

    def get(arch: str) -> ModelRuntime:
        if arch not in cache:
            cache[arch] = ModelRuntime.load(model_dirs[arch], device="cpu")
        return cache[arch]

    return get


@pytest.fixture(scope="session")
def make_service(model_dirs):
    """Build a fresh service (own cache and metrics) for a family; options go to ServiceConfig."""

    built = []

    def make(arch: str, **overrides):
        cfg = dict(
            model_dir=model_dirs[arch],
            served_model_name=f"tiny-{arch}",
            device="cpu",
            cache_bytes=64 << 20,
            policy=CheckpointPolicy(),
        )
        cfg.update(overrides)
        built.append(build_service(ServiceConfig(**cfg)))
        return built[-1]

    make.built = built  # (the `force` fixture finds a runtime's engine here)
    yield make
    for svc in built:  # a worker thread left inside torch at interpreter exit would abort the process
        svc.engine.stop()


@pytest.fixture(params=FAMILIES)
def family(request):
    return request.param

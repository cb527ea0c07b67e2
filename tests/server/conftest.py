import sys

import pytest

from hyserve.server.run import BackgroundServer


@pytest.fixture(scope="module")
def servers(request):
    """One real uvicorn server per family for the module, started on first use."""
    make_service = request.getfixturevalue("make_service")
    running: dict[str, BackgroundServer] = {}

    def get(arch: str) -> BackgroundServer:
        if arch not in running:
            running[arch] = BackgroundServer(make_service(arch)).__enter__()
        return running[arch]

    yield get
    for srv in running.values():
        srv.__exit__(None, None, None)


@pytest.fixture(scope="module")
def qwen35_server(servers):
    return servers("qwen3_5")


@pytest.fixture(scope="module")
def template_servers(request):
    """get(arch, template file name): a real server on a tiny `arch` model with that real chat template (one
    per pair for the module; skips when the templates are absent). Extra ServiceConfig options: `**options`."""
    make_service = request.getfixturevalue("make_service")
    dirs = request.getfixturevalue("template_model_dirs")
    running: dict[tuple, BackgroundServer] = {}

    def get(arch: str, template: str, **options) -> BackgroundServer:
        key = (arch, template, tuple(sorted(options.items())))
        if key not in running:
            svc = make_service(arch, model_dir=dirs(arch, template), served_model_name="tpl", **options)
            running[key] = BackgroundServer(svc).__enter__()
        return running[key]

    yield get
    for srv in running.values():
        srv.__exit__(None, None, None)


@pytest.fixture
def force(make_service):
    """force(runtime, text) -> seed: a request with that seed to the engine of `runtime` (a `make_service`
    service) generates exactly `text`'s tokens, then end of turn, through the real engine
    (`hyserve.testing.forced.ForcedReplies`). Requests with other seeds sample as usual."""
    from hyserve.testing.forced import ForcedReplies

    forced = ForcedReplies()

    def seed(runtime, text: str) -> int:
        engines = [svc.engine for svc in make_service.built if svc.runtime is runtime]
        assert engines, "force: no make_service service runs this runtime"
        for engine in engines:
            forced.attach(engine)
        return forced.seed_for(runtime.tokenizer, text)

    yield seed
    forced.detach()


def serve_command(model_dir, port: int, *flags: str) -> list[str]:
    """The command line of a `hyserve serve` process on `port`, its model served as "m", on the CPU."""
    cmd = [sys.executable, "-m", "hyserve.cli", "serve", str(model_dir), "--port", str(port)]
    return [*cmd, "--served-model-name", "m", "--device", "cpu", *flags]


def wait_healthy(base: str, proc, output=lambda: "", limit: float = 120) -> None:
    """Until the `hyserve serve` process `proc` answers 200 on /health; fails with `output()` if it exits first
    or takes longer than `limit` seconds."""
    import time

    import httpx

    deadline = time.time() + limit
    while True:
        try:
            if httpx.get(f"{base}/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.time() < deadline and proc.poll() is None, output()
        time.sleep(0.2)

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

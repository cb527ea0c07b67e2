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
def force(monkeypatch):
    """force(runtime, text) -> seed: a request with that seed generates exactly `text`'s tokens, then end of
    turn, through the real engine (sampling is replaced; everything after it runs as always). Requests with
    other seeds sample as usual."""
    import itertools

    from hyserve.sampling import Sampler

    scripts: dict[int, list[int]] = {}
    seeds = itertools.count(424242)
    sample = Sampler.__call__

    def scripted(self, logits):
        script = scripts.get(self.params.seed)
        if script is None:
            return sample(self, logits)
        at = self.__dict__.get("_forced_at", 0)
        self._forced_at = at + 1
        return script[min(at, len(script) - 1)]

    monkeypatch.setattr(Sampler, "__call__", scripted)

    def make(runtime, text: str) -> int:
        seed = next(seeds)
        tok = runtime.tokenizer
        scripts[seed] = list(tok(text, add_special_tokens=False)["input_ids"]) + [tok.eos_token_id]
        return seed

    return make

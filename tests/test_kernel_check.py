"""The load-time check: a kernel that does not match the installed transformers is refused, and the model
then runs transformers' own functions, token for token."""

import dataclasses

import pytest
import torch

from hyserve import kernels, model_thread
from hyserve.kernels import conv, delta_rule
from hyserve.models.runtime import ModelRuntime

PROMPT = [5, 17, 42, 8, 99, 23, 61, 7, 3, 77, 14]


@pytest.fixture(autouse=True)
def _keep_module_hooks():
    """Where transformers has no per-layer slots, hooks replace module-level functions process-wide and a
    refused kernel unhooks them: put them back for the other tests' models."""
    import sys

    homes = [m for name, m in list(sys.modules.items()) if name.startswith("transformers.models.")]
    names = {k.legacy for k in kernels.FUNCTIONS}
    saved = [(m, n, m.__dict__[n]) for m in homes for n in names if n in m.__dict__]
    yield
    for m, n, f in saved:
        setattr(m, n, f)


def _greedy(rt: ModelRuntime, n: int = 8) -> list[int]:
    """n greedy tokens through hyserve's adapter on the model thread (where kernels apply)."""

    def run():
        ad = rt.adapter
        state, out = ad.new_state(), []
        logits = ad.forward(state, PROMPT)
        for _ in range(n):
            out.append(int(torch.argmax(logits)))
            logits = ad.forward_batch([state], [out[-1]])[0]
        ad.drop_batch()
        return out

    return model_thread.run(run)


def _transformers(rt: ModelRuntime, n: int = 8) -> list[int]:
    ids = torch.tensor([PROMPT])
    with torch.inference_mode():
        out = rt.model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, pad_token_id=0
        )
    return out[0, len(PROMPT) :].tolist()


def _wrong(kernel):
    """`kernel`, off by a little in its first result."""

    def fast(reference, *args, **kwargs):
        out = kernel.fast(reference, *args, **kwargs)
        return (out[0] + 1e-2, *out[1:]) if isinstance(out, tuple) else out + 1e-2

    return dataclasses.replace(kernel, fast=fast)


def test_every_kernel_passes_the_check_on_the_installed_transformers(runtimes):
    # float32 models: the C step is written for bfloat16 ones (tests/test_native_kernels.py)
    every = tuple(k for k in kernels.ALL if not k.startswith("native_"))
    for arch, expected in (("qwen3_5", every), ("mamba2", ("linear", "causal_conv1d_update", "causal_conv1d_fn"))):
        status = runtimes(arch).adapter.kernels.status
        assert all(status.get(name) == "on" for name in expected), (arch, status)


@pytest.mark.parametrize(
    "wrong", [delta_rule.RECURRENT, delta_rule.CHUNKED, conv.STEP, conv.PREFILL], ids=lambda k: k.name
)
def test_a_wrong_kernel_is_refused_and_the_output_stays_transformers(model_dirs, monkeypatch, caplog, wrong):
    monkeypatch.setattr(kernels, "FUNCTIONS", tuple(_wrong(k) if k is wrong else k for k in kernels.FUNCTIONS))
    rt = ModelRuntime.load(model_dirs["qwen3_5"], device="cpu")
    report = rt.adapter.kernels
    assert report.status[wrong.name].startswith("off: max |diff|"), report.status
    assert wrong.name in caplog.text  # one warning names it
    assert report.on("attention") and report.on("linear")  # the others stay on
    if wrong in (delta_rule.CHUNKED, conv.PREFILL):
        assert not report.on("capture")  # capture needs both prefill kernels
    assert _greedy(rt) == _transformers(rt)


def test_a_kernel_the_probes_miss_is_caught_by_the_model_check(model_dirs, monkeypatch):
    """A kernel whose own probes cannot see it is wrong (here: none) still meets the whole-model check, and
    then every kernel goes back off."""
    unprobed = dataclasses.replace(_wrong(delta_rule.RECURRENT), probes=lambda layer: [])
    monkeypatch.setattr(kernels, "FUNCTIONS", (unprobed, *kernels.FUNCTIONS[1:]))
    rt = ModelRuntime.load(model_dirs["qwen3_5"], device="cpu")
    status = rt.adapter.kernels.status
    assert all(v.startswith("off: the model with kernels differs") for k, v in status.items() if k != "capture"), status
    assert not any(
        hasattr(m.__dict__.get("forward"), "__func__") for m in rt.model.modules() if type(m) is torch.nn.Linear
    )  # unhooked
    assert _greedy(rt) == _transformers(rt)


def test_a_wrong_captured_state_switches_capture_off(model_dirs, monkeypatch):
    """Conv windows captured one column off: the piece itself is right, the states handed out are not."""
    real = conv._conv_window
    monkeypatch.setattr(conv, "_conv_window", lambda x, end, kernel: real(x, max(0, end - 1), kernel))
    rt = ModelRuntime.load(model_dirs["qwen3_5"], device="cpu")
    report = rt.adapter.kernels
    assert report.on(delta_rule.CHUNKED.name) and report.on(conv.PREFILL.name)
    assert report.status["capture"].startswith("off: a captured state differs"), report.status
    assert not model_thread.run(rt.adapter.can_capture)  # checkpoints inside a piece: by split prefills instead


def test_disabled_kernels_leave_transformers_alone(model_dirs, monkeypatch):
    monkeypatch.setenv("HYSERVE_KERNELS", "0")
    rt = ModelRuntime.load(model_dirs["qwen3_5"], device="cpu")
    assert all(v.startswith("off: disabled") for v in rt.adapter.kernels.status.values())
    assert rt.adapter.kernels.refused == {}
    assert _greedy(rt) == _transformers(rt)


def test_hyserve_env_reports_versions_and_the_kernel_check(model_dirs, capsys):
    from hyserve.cli import main

    assert main(["env", str(model_dirs["mamba2"])]) == 0
    out = capsys.readouterr().out
    assert "transformers: " in out and "torch: " in out
    assert "kernel causal_conv1d_fn: on" in out

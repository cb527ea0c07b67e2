"""The one patch registry (`kernels.seam`): every attribute hyserve's kernels set on a model is recorded there,
and reverting puts each one back to the original, so the model is plain transformers again."""

import pytest
import torch

from hyserve import model_thread
from hyserve.kernels import seam
from hyserve.models.runtime import ModelRuntime

from .test_kernel_check import _greedy, _transformers


def _hyserve_attributes(model) -> set[tuple[int, str]]:
    """(id of the owner, name) of every attribute hyserve may have put on `model`: instance forwards of its
    modules and of their kernel slots, and any `_hyserve_` attribute (the registry's own excepted)."""
    found = set()
    for module in model.modules():
        owners = [module, *(module.__dict__.get("_kernel_funcs") or {}).values()]
        for owner in owners:
            for name in owner.__dict__:
                if name == "forward" or (name.startswith("_hyserve_") and name != "_hyserve_patches"):
                    found.add((id(owner), name))
    return found


@pytest.fixture(scope="module")
def bf16_runtime(model_dirs):
    return ModelRuntime.load(model_dirs["qwen3_5"], dtype="bfloat16", device="cpu")


def test_every_patch_is_recorded_and_revert_all_restores_each_original(bf16_runtime):
    rt = bf16_runtime
    model, registry = rt.model, seam.patches(rt.model)
    on = {k for k, v in rt.adapter.kernels.status.items() if v == "on"}
    assert {"linear", "norm", "decode_layer", "attention"} <= on, rt.adapter.kernels.status
    recorded = list(registry)
    assert {"linear", "norm", "decode_layer", "attention"} <= registry.kernels()
    # nothing a kernel set is missing from the registry
    assert _hyserve_attributes(model) <= {(id(p.owner), p.name) for p in recorded}
    assert model.config._attn_implementation != "sdpa"
    want = _greedy(rt)

    model_thread.run(seam.revert_all, model)
    assert list(registry) == []
    for p in recorded:
        if p.undo is None:
            assert p.owner.__dict__.get(p.name, seam.MISSING) is p.original, (p.kernel, p.name)
    assert _hyserve_attributes(model) == set()
    assert model.config._attn_implementation == "sdpa"
    assert not any(
        hasattr(f.__dict__.get("forward"), "reference") for _, f in seam.slots(model, "chunk_gated_delta_rule")
    )
    got = _greedy(rt)  # transformers' own functions now, on the model thread too
    assert got == _transformers(rt)
    assert got == want


def test_one_kernel_reverts_alone(model_dirs):
    rt = ModelRuntime.load(model_dirs["qwen3_5"], device="cpu")
    model, registry = rt.model, seam.patches(rt.model)
    norms = [p for p in registry if p.kernel == "norm"]
    others = [p for p in registry if p.kernel != "norm"]
    assert norms and others
    model_thread.run(seam.revert, model, "norm")
    assert all(p.owner.__dict__.get(p.name, seam.MISSING) is p.original for p in norms)
    assert all(p.undo is not None or p.owner.__dict__.get(p.name) is p.value for p in others)  # still on
    assert list(registry) == others
    assert not any(getattr(m.__dict__.get("forward"), "form", None) for m in model.modules())


def test_setting_twice_keeps_the_first_original():
    layer = torch.nn.Linear(2, 2)
    registry = seam.Patches()
    registry.set("a", layer, "forward", lambda x: x)
    registry.set("b", layer, "forward", lambda x: 2 * x)
    assert [p.kernel for p in registry] == ["b"]
    registry.revert()
    assert "forward" not in layer.__dict__ and layer.forward.__func__ is torch.nn.Linear.forward

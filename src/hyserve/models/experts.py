"""Which of transformers' implementations runs a mixture-of-experts model's experts, chosen at load.

transformers (5.24 and later) runs the experts of a MoE model (`@use_experts_implementation`: Qwen3.5-MoE,
Qwen3-Next, ...) one of several ways: "eager" (a loop over the experts a batch hit), "grouped_mm" (one
grouped matrix product over the tokens sorted by expert; its default) or "batched_mm" (each token's
experts' weights gathered, then one batched product). grouped_mm does the products of eager without its
per-expert bookkeeping (a one-hot mask, and a scatter-add into the output for every expert hit, which shows
high in a CPU profile of eager); batched_mm copies a weight matrix per token and expert, which a prefill
piece cannot afford on CPU. `benchmarks/bench_real.py --model real-moe --experts eager,grouped_mm,batched_mm`
measures them.

hyserve asks for PREFERRED explicitly instead of relying on the default, and only after the model with
it gives the same logits as with eager (the reference loop) on a prefill piece, a cached piece and a
batched decode step (`kernels.verify.model_passes`); otherwise eager runs. `HYSERVE_EXPERTS=NAME` asks
for another implementation, with the same check.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger("hyserve.experts")

PREFERRED = "grouped_mm"
REFERENCE = "eager"


def is_moe(model) -> bool:
    """Whether `model` has experts whose implementation transformers lets one choose."""
    can_set = getattr(model, "_can_set_experts_implementation", None)
    return bool(can_set and can_set() and hasattr(model, "set_experts_implementation"))


def current(model) -> str | None:
    """The implementation the model's experts run now (None: not a MoE model)."""
    return model.config.get_text_config()._experts_implementation if is_moe(model) else None


def choose(model, adapter, vocab: int) -> str | None:
    """Set the experts implementation of `model` (on the model thread, after loading) and return it; None
    for a model without experts. Falls back to eager, with a warning, when the wanted one cannot run or
    differs from eager on this model."""
    if not is_moe(model):
        return None
    from ..kernels import verify

    wanted = os.environ.get("HYSERVE_EXPERTS", PREFERRED)
    if wanted == REFERENCE:
        model.set_experts_implementation(REFERENCE)
        return REFERENCE
    dtype = next(model.parameters()).dtype
    try:
        model.set_experts_implementation(REFERENCE)
        want = verify.model_passes(adapter, vocab)
        model.set_experts_implementation(wanted)
        got = verify.model_passes(adapter, vocab)
        why = verify._relative_mismatch(got, want, dtype)
    except Exception as exc:  # an implementation that cannot run here is as good as a wrong one
        why = f"raised {type(exc).__name__}: {exc}"
    if why:
        log.warning("experts implementation %s differs from eager on this model (%s): eager runs instead", wanted, why)
        model.set_experts_implementation(REFERENCE)
        return REFERENCE
    return wanted

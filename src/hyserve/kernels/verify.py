"""The load-time check: a kernel is switched on only where it matches the installed transformers.

hyserve's kernels stand in for transformers' reference functions, and transformers changes what those
functions are handed from one release to the next (5.25 moved the conv state into a new
`causal_conv1d_forward` and changed the cache API). So nothing is trusted from a version number: at load,
each kernel runs on inputs of the model's own shapes next to the reference it replaces, and the model as
a whole runs a prefill piece, a cached piece and a batched decode step with and without the kernels.
Whatever does not match within float tolerance stays off. A library change may make hyserve slower;
it must not make it wrong.
"""

from __future__ import annotations

import contextlib

import torch

from .seam import reference_only


def tolerance(dtype: torch.dtype) -> float:
    """Closeness required of a kernel's result: float32 rounding, or a few units of the last place of a
    16-bit result."""
    return 1e-4 if dtype == torch.float32 else 3e-2


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return []


def _clone(value):
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, tuple):
        return tuple(_clone(v) for v in value)
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    return value


def mismatch(got, want, dtype: torch.dtype) -> str | None:
    """Why `got` differs from `want` (tensors, or tuples of them, compared in order), or None."""
    a, b = _tensors(got), _tensors(want)
    if len(a) != len(b):
        return f"{len(a)} results where the reference gives {len(b)}"
    tol = tolerance(dtype)
    for x, y in zip(a, b):
        if x.shape != y.shape:
            return f"shape {tuple(x.shape)} where the reference gives {tuple(y.shape)}"
        x, y = x.float(), y.float()
        if not torch.isfinite(x).all() and torch.isfinite(y).all():
            return "non-finite values"
        if not torch.allclose(x, y, atol=tol, rtol=tol):
            return f"max |diff| {(x - y).abs().max().item():.2e} over tolerance {tol:.0e}"
    return None


def check_function(kernel, reference, layer) -> str | None:
    """Run `kernel` and `reference` on the probes of `layer`; the first mismatch, or None."""
    for args, kwargs, mutated in kernel.probes(layer):
        want_args, want_kwargs = _clone(args), _clone(kwargs)
        got_args, got_kwargs = _clone(args), _clone(kwargs)
        try:
            if not kernel.applies(*got_args, **got_kwargs):
                return "does not apply to this model's shapes"
            got = kernel.fast(reference, *got_args, **got_kwargs)
        except Exception as exc:  # a kernel that cannot run here is as good as a wrong one
            return f"raised {type(exc).__name__}: {exc}"
        want = reference(*want_args, **want_kwargs)
        dtype = next((t.dtype for t in _tensors(args) if t.is_floating_point()), torch.float32)
        why = mismatch((got, *(got_args[i] for i in mutated)), (want, *(want_args[i] for i in mutated)), dtype)
        if why:
            return why
    return None


def model_passes(adapter, vocab: int, seed: int = 0) -> list[torch.Tensor]:
    """Logits of a few passes that cover every hooked function through the real model: a 16-token prefill
    piece (chunked rule, conv prefill, skinny linear rows), a 3-token piece over that cache, and a
    two-row batched decode step (recurrent step, conv step)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (24,), generator=g).tolist()
    first, second = adapter.new_state(), adapter.new_state()
    try:
        out = [adapter.forward(first, ids[:16], all_logits=True), adapter.forward(first, ids[16:19], all_logits=True)]
        adapter.forward(second, ids[19:23])
        out.append(adapter.forward_batch([first, second], [ids[23], ids[0]]))
    finally:
        adapter.drop_batch()
    return out


@contextlib.contextmanager
def float_activations(model):
    """Products that round their inputs to Q8_0 blocks (`rounds_activations`: w8a8 / w4a8, a GGUF file's blocks)
    take them as they are for the duration. The model checks compare hyserve's kernels with transformers'
    functions, and a rounding step turns their float32 noise into a jump of one int8 step; those products are
    checked against their own reference apart (`quant.native`, `quant.ggml_native`)."""
    layers = [m for m in model.modules() if getattr(m, "rounds_activations", False) is True]
    for m in layers:
        m.rounds_activations = False
    try:
        yield
    finally:
        for m in layers:
            m.rounds_activations = True


def check_model(adapter, vocab: int, dtype: torch.dtype) -> str | None:
    """`model_passes` with the kernels against the same passes with transformers' own functions."""
    with float_activations(adapter.model):
        try:
            got = model_passes(adapter, vocab)
        except Exception as exc:
            return f"the model raised {type(exc).__name__}: {exc}"
        with reference_only():
            want = model_passes(adapter, vocab)
    return _relative_mismatch(got, want, dtype)


def check_capture(adapter, vocab: int, dtype: torch.dtype, seed: int = 1) -> str | None:
    """A state captured inside a prefill piece must continue exactly like the state of a prefill split there."""
    with float_activations(adapter.model):
        return _check_capture(adapter, vocab, dtype, seed)


def _check_capture(adapter, vocab: int, dtype: torch.dtype, seed: int) -> str | None:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (20,), generator=g).tolist()
    live, split = adapter.new_state(), adapter.new_state()
    adapter.forward(live, ids[:4])
    try:
        _, captured = adapter.forward_capturing(live, ids[4:16], [3, 7])
    except Exception as exc:
        return f"raised {type(exc).__name__}: {exc}"
    if captured is None:
        return "the kernels handed out no states"
    adapter.forward(split, ids[:4])
    adapter.forward(split, ids[4:11])
    at = adapter.restore(adapter.snapshot(captured[1]), captured[1].tokens)
    if at.tokens != split.tokens:
        return "captured at the wrong token"
    return _relative_mismatch(
        [adapter.forward(at, ids[11:20], all_logits=True)], [adapter.forward(split, ids[11:20], all_logits=True)], dtype
    )


def _relative_mismatch(got: list[torch.Tensor], want: list[torch.Tensor], dtype: torch.dtype) -> str | None:
    """Logits compared relative to their scale: a model's many layers add up rounding differences."""
    tol = tolerance(dtype) * 10
    for a, b in zip(got, want):
        scale = max(b.abs().max().item(), 1.0)
        diff = (a - b).abs().max().item()
        if not diff <= tol * scale:  # also catches NaN
            return f"logits differ by {diff:.2e} (scale {scale:.1f}, tolerance {tol:.0e})"
    return None

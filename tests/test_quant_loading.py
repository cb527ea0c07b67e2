"""`--quantization` quantizes each weight as transformers loads it (`quant.loading`): the blocks are the ones a
plain load followed by `quant.apply` makes, for every family, and the float model never exists whole (the load's
peak resident memory stays well below the float weights' size)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from hyserve import model_thread, quant
from hyserve.quant import layout, loading, mapped_pages
from hyserve.testing.tiny import ARCHS


def _state(model) -> dict[str, torch.Tensor]:
    return {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers())}


# every family in the load's dtype; the float32 cast and w4a8 (its Q6_0 head) on one dense and one MoE family
CASES = [(arch, scheme, "bfloat16") for arch in ARCHS for scheme in ("int8", "int4")] + [
    (arch, scheme, dtype)
    for arch in ("qwen3_5", "qwen3_5_moe")
    for scheme, dtype in (("int8", "float32"), ("int4", "float32"), ("w4a8", "bfloat16"))
]


@pytest.mark.parametrize("arch,scheme,dtype", CASES)
def test_quantizing_while_loading_makes_the_blocks_a_load_then_apply_makes(model_dirs, arch, scheme, dtype):
    """Every tensor of the model (values, scales, the weights kept in float, buffers), what `describe` says, and
    which tensors are one (a tied head and embedding) are the same either way."""
    _same_either_way(model_dirs[arch], scheme, getattr(torch, dtype))


@pytest.mark.parametrize("scheme", ["int8", "int4", "w4a8"])
def test_a_tied_head_is_quantized_while_loading_as_the_head(model_dirs, tmp_path, scheme):
    """The tiny models' heads are their own weights; real Qwen3.5 ties its head to the embedding, which transformers
    ties only at the end of the load: the embedding is still quantized at the head's format (Q8_0 under int4, Q6_0
    under w4a8), one tensor with the head."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dirs["qwen3_5"])
    config.tie_word_embeddings = True
    model = model_thread.run(lambda: AutoModelForCausalLM.from_config(config, dtype=torch.float32))
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    model.save_pretrained(tmp_path)
    _copy_tokenizer(model_dirs["qwen3_5"], tmp_path)
    got = _same_either_way(tmp_path, scheme, torch.bfloat16)
    head, embedding = got.get_output_embeddings(), got.get_input_embeddings()
    assert head.qs is embedding.qs and layout.format_of(head.qs, head.d) == ("q6_0" if scheme == "w4a8" else "q8_0")
    ids = torch.tensor([[0, 9, 17], [250, 3, 3]])
    rows = head.weight[ids]
    model_thread.run(lambda: quant.install_products(got, torch.bfloat16))  # w4a8: the C product's held order
    assert head.interleaved == embedding.interleaved == (scheme == "w4a8")
    assert torch.equal(embedding(ids), rows) and torch.equal(head.weight[ids], rows)


def _copy_tokenizer(src, out) -> None:
    """The tiny folder's tokenizer, template and generation config, beside weights saved anew."""
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template", "generation_config")):
            shutil.copy(f, out / f.name)


def _same_either_way(folder, scheme: str, torch_dtype: torch.dtype):
    """The model quantized while loading, once checked against a load then `apply`."""
    from transformers import AutoModelForCausalLM

    def after() -> tuple:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch_dtype, local_files_only=True)
        return model, quant.apply(model, scheme)

    def during() -> tuple:
        model, made = loading.load(folder, torch_dtype, scheme)
        assert made.held, "nothing was quantized while loading"
        return model, quant.apply(model, scheme, made.held)

    (want, want_done), (got, got_done) = model_thread.run(after), model_thread.run(during)
    assert got_done.describe() == want_done.describe()
    assert got_done.kept == want_done.kept
    want_state, got_state = _state(want), _state(got)
    assert list(got_state) == list(want_state)
    for name, tensor in want_state.items():
        assert got_state[name].dtype == tensor.dtype, name
        assert torch.equal(got_state[name], tensor), name
    shared = lambda state: {n: t.data_ptr() for n, t in state.items() if t.numel()}  # noqa: E731
    same = lambda state: {(a, b) for a in shared(state) for b in shared(state) if shared(state)[a] == shared(state)[b]}  # noqa: E731
    assert same(got_state) == same(want_state)
    return got
    assert not getattr(got, "hf_quantizer", None) and not hasattr(got.config, "quantization_config")


def test_blocks_of_another_format_than_apply_chooses_are_refused(model_dirs):
    """A loader that quantized a weight at another format than `apply` would (here the head at Q4_0) is caught,
    not served: the check behind the identity above."""
    model, made = loading.load(model_dirs["qwen3"], torch.float32, "int4")
    head = model.get_output_embeddings().weight
    qs, d = quant.layout.quantize(torch.randn(head.shape), "int4")
    made.held[id(head)] = (qs, d)
    with pytest.raises(RuntimeError, match="another format than int8"):
        quant.apply(model, "int4", made.held)


def test_a_placeholder_apply_does_not_replace_is_refused(model_dirs):
    """A weight quantized at load whose module `apply` does not replace would compute over its placeholder: refused."""
    model, made = loading.load(model_dirs["qwen3"], torch.float32, "int8")
    down = model.model.layers[0].mlp.down_proj
    down.__class__ = type("Other", (torch.nn.Linear,), {})  # a layer `apply` does not take for an nn.Linear
    with pytest.raises(RuntimeError, match="quantized at load but not replaced: model.layers.0.mlp.down_proj.weight"):
        quant.apply(model, "int8", made.held)


def test_a_tensor_s_mapped_pages_are_dropped_once_it_is_gone_and_only_then(tmp_path):
    """A full read is a view of the file's mapping at the tensor's own address; once it is gone its pages are
    handed back (the bytes read again are the file's); a partial read, or one after the files are closed, is
    left alone."""
    from safetensors.torch import save_file

    tensors = {"a": torch.arange(3 << 20, dtype=torch.float32), "b": torch.ones(1000)}
    save_file(tensors, tmp_path / "model.safetensors")
    dropped = []
    with mapped_pages.released([tmp_path / "model.safetensors"]) as state:
        state["a"].files.drop = lambda start, end: dropped.append((start, end))
        a = state["a"][...]
        at, size = a.data_ptr(), a.numel() * 4
        assert torch.equal(a, tensors["a"]) and not dropped
        del a
        assert dropped == [(at, at + size)]
        part = state["a"][:10]
        del part
        assert len(dropped) == 1
    with mapped_pages.released([tmp_path / "model.safetensors"]) as state:
        a = state["a"][...]
        a.sum()  # its pages resident
        del a  # really dropped
        assert torch.equal(state["a"][...], tensors["a"]) and torch.equal(state["b"][...], tensors["b"])
        b = state["b"][...]
    del b  # after the files closed: nothing to drop, nothing raised
    with mapped_pages.released(None) as state:
        assert state is None


PEAK = textwrap.dedent(
    """
    import json, sys
    from hyserve.models.runtime import ModelRuntime
    import transformers.models.qwen3.modeling_qwen3  # imported before the baseline: its code is not weights

    def status(key):
        return next(int(line.split()[1]) << 10 for line in open("/proc/self/status") if line.startswith(key))

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak resident memory, VmHWM, starts again from now
    before = status("VmRSS")
    rt = ModelRuntime.load(sys.argv[1], dtype="float32", device="cpu", quantization="int8")
    print(json.dumps({"peak": status("VmHWM") - before, "after": rt.quantization.bytes_after}))
    """
)


@pytest.fixture(scope="module")
def float_weights(model_dirs, tmp_path_factory):
    """A qwen3 folder of 12 layers holding ~190 MB of float32 weights, none over 4 MiB; its tokenizer the tiny's."""
    from transformers import AutoConfig, AutoModelForCausalLM

    out = tmp_path_factory.mktemp("float-weights")
    tiny = model_dirs["qwen3"]
    config = AutoConfig.from_pretrained(tiny)
    config.update(
        {"hidden_size": 512, "intermediate_size": 2048, "num_hidden_layers": 12, "head_dim": 128}
        | {"num_attention_heads": 4, "num_key_value_heads": 2, "layer_types": ["full_attention"] * 12}
    )
    model = model_thread.run(lambda: AutoModelForCausalLM.from_config(config, dtype=torch.float32))
    model.save_pretrained(out)
    _copy_tokenizer(tiny, out)
    return out, sum(p.numel() * 4 for p in model.parameters())


def test_the_load_never_holds_the_float_model(float_weights, monkeypatch):
    """The load's peak resident memory (anonymous and the checkpoint's mapped pages alike) above what the
    process held before it stays below 80% of the float32 weights: loading them whole, then quantizing, peaks
    above 100% (the float model, then its blocks besides); quantizing each weight as it comes holds the
    blocks (27%) and one weight's float copies at a time (62% with the lowest releases pyproject allows)."""
    folder, float_bytes = float_weights
    monkeypatch.setenv("HYSERVE_KERNELS", "0")  # the load alone, not the kernels' checks
    run = subprocess.run([sys.executable, "-c", PEAK, str(folder)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    got = json.loads(run.stdout.splitlines()[-1])
    assert got["after"] < 0.3 * float_bytes
    assert got["peak"] < 0.8 * float_bytes, (got, float_bytes)

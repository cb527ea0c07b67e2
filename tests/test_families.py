"""Every hybrid family of issue 21 through the same engine: what each adapter says of its layers is what
transformers builds; split prefill == one prefill; batched == solo; the 6-turn chat with the cache on ==
off (reusing at least the history), with the real chat templates for Nemotron-H, Granite 4.0 and LFM2;
speculation on == off. (Greedy == transformers `generate()` through the `openai` client:
tests/server/test_families_api.py.) The checks are those the first families pass, run on these."""

from pathlib import Path

import pytest
from transformers import DynamicCache

from hyserve.families import REGISTRY
from hyserve.state.layer_kinds import kind
from hyserve.testing.tiny import _TINY, ARCHS

from . import test_batching, test_engine_cache, test_speculative, test_state
from .conftest import HYBRIDS

TEMPLATES = Path(__file__).resolve().parents[1].parent / "shared" / "fixtures" / "chat_templates"
REAL_TEMPLATES = {
    "nemotron_h": "NVIDIA-Nemotron-Nano-v2.jinja",
    "granitemoehybrid": "ibm-granite-granite-4.0.jinja",
    "lfm2": "LFM2.5-Instruct.jinja",
}


def test_every_model_type_of_issue_21_is_served():
    for model_type in (
        "qwen3_5_moe",
        "nemotron_h",
        "granitemoehybrid",
        "falcon_h1",
        "lfm2",
        "lfm2_moe",
        "jamba",
        "bamba",
        "zamba2",
    ):
        assert model_type in REGISTRY
    assert all(_TINY[arch]["model_type"] in REGISTRY for arch in ARCHS)


@pytest.mark.parametrize("arch", ARCHS)
def test_each_adapter_says_what_its_layers_hold(runtimes, arch):
    """The kinds an adapter declares per layer type are the kinds of the cache transformers builds for it."""
    model = runtimes(arch).model
    adapter = runtimes(arch).adapter
    config = model.config.get_text_config()
    cache = DynamicCache(config=config)
    types = list(config.layer_types)
    assert len(types) == len(cache.layers)
    assert [kind(layer).name for layer in cache.layers] == [adapter.state_layers[t] for t in types]


@pytest.mark.parametrize("arch", HYBRIDS)
def test_split_prefill_through_snapshot_equals_one_prefill(runtimes, arch):
    test_state.test_split_prefill_through_snapshot_equals_full_prefill(runtimes, arch)
    rt = runtimes(arch)
    live = rt.adapter.new_state()
    rt.adapter.forward(live, test_state._ids(rt, 10))
    assert not rt.adapter.can_truncate(live)  # every one of them holds a recurrent state


@pytest.mark.parametrize("arch", HYBRIDS)
def test_a_checkpoint_inside_a_piece_is_captured_or_the_prefill_split(runtimes, arch):
    """Qwen3.5-MoE's Gated DeltaNet layers hand out states inside a piece (hyserve's kernels); the others
    split the prefill at a checkpoint."""
    from hyserve import model_thread

    if arch == "qwen3_5_moe":
        test_state.test_states_captured_inside_a_piece_equal_split_prefills(runtimes, arch, 17, [5, 21, 29])
    else:
        assert not model_thread.run(runtimes(arch).adapter.can_capture)


@pytest.mark.parametrize("arch", HYBRIDS)
def test_the_state_after_a_split_prefill_equals_one_prefills(runtimes, arch):
    """Every tensor of the state, not only the logits (a recurrent state that a piece ignored can hide in
    logits that decay it away: transformers' Jamba scan over a piece starts from zero)."""
    rt = runtimes(arch)
    ad = rt.adapter
    ids = test_state._ids(rt, 40, seed=5)
    one, split = ad.new_state(), ad.new_state()
    ad.forward(one, ids)
    for piece in (ids[:25], ids[25:33], ids[33:]):
        ad.forward(split, piece)
    want, got = test_state._tensors(one.cache), test_state._tensors(split.cache)
    assert len(got) == len(want)
    for a, b in zip(got, want):  # relative to each tensor's size: Jamba's piece scan from zero is off by 2e-3
        assert a.shape == b.shape and (a - b).norm() <= 1e-5 * b.norm()


@pytest.mark.parametrize("arch", HYBRIDS)
def test_a_restored_state_never_writes_into_its_snapshot(runtimes, arch):
    test_state.test_a_restored_state_never_writes_into_its_snapshot(runtimes, arch)


@pytest.mark.parametrize("arch", HYBRIDS)
def test_batched_decode_equals_solo(runtimes, arch, monkeypatch):
    test_batching.test_persistent_batch_equals_solo_decode(runtimes, arch, monkeypatch)


@pytest.mark.parametrize("arch", HYBRIDS)
def test_six_turn_chat_matches_cache_off(make_service, arch):
    test_engine_cache.test_six_turn_chat_matches_cache_off(make_service, arch)


@pytest.mark.parametrize("arch", HYBRIDS)
def test_oracle_speculation_equals_plain_decode(make_service, arch):
    test_speculative.test_oracle_speculation_equals_plain_decode(make_service, arch, True)


@pytest.fixture(scope="module")
def templated_dirs(model_dirs, tmp_path_factory):
    """Tiny models of the families whose real chat template is in ../shared: their tokenizer has the
    template's control strings as special tokens (as the real tokenizers do) and the embeddings grow to
    match."""
    import shutil

    from hyserve import model_thread

    from .test_next_turn import _tokenizer

    built = {}

    def get(arch):
        path = TEMPLATES / REAL_TEMPLATES[arch]
        if not path.exists():
            pytest.skip("../shared/fixtures/chat_templates is absent")
        if arch not in built:
            out = tmp_path_factory.mktemp(f"{arch}-template")
            shutil.copytree(model_dirs[arch], out, dirs_exist_ok=True)
            tok = _tokenizer(path.read_text())

            def grow():
                from transformers import AutoModelForCausalLM

                model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
                model.resize_token_embeddings(len(tok), mean_resizing=False)
                model.save_pretrained(out)

            model_thread.run(grow)
            tok.save_pretrained(out)
            built[arch] = out
        return built[arch]

    return get


@pytest.mark.parametrize("arch", sorted(REAL_TEMPLATES))
def test_six_turn_chat_with_the_real_template_matches_cache_off(make_service, templated_dirs, arch):
    model_dir = templated_dirs(arch)
    probe = make_service(arch, model_dir=model_dir, cache_enabled=False)
    assert probe.runtime.tokenizer.chat_template == (TEMPLATES / REAL_TEMPLATES[arch]).read_text()
    test_engine_cache.test_six_turn_chat_matches_cache_off(
        lambda a, **kw: make_service(a, model_dir=model_dir, **kw), arch
    )

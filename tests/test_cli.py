"""The console script: make-tiny-model writes a loadable model; demo runs end to end; bad dirs fail clearly."""

import json
import subprocess
import sys


def run(*args, **kw):
    return subprocess.run(
        [sys.executable, "-m", "hyserve.cli", *args], capture_output=True, text=True, timeout=300, **kw
    )


def test_make_tiny_model(tmp_path):
    r = run("make-tiny-model", str(tmp_path / "m"), "--arch", "mamba2")
    assert r.returncode == 0, r.stderr
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    assert cfg["model_type"] == "mamba2"
    assert (tmp_path / "m" / "tokenizer.json").exists() and list((tmp_path / "m").glob("*.safetensors"))


def test_the_real_moe_size_has_the_35b_a3b_layer():
    """`--size real-moe` (checked without writing its 2.9 GB): Qwen3.5-35B-A3B's layer dimensions, fewer
    experts and layers; its parameters counted on the meta device."""
    import torch
    from transformers import AutoModelForCausalLM

    from hyserve.testing.tiny import default_arch, model_config, train_tokenizer

    assert default_arch("real-moe") == "qwen3_5_moe" and default_arch("real-0.8b") == "qwen3_5"
    config, save_dtype = model_config("qwen3_5_moe", "real-moe", train_tokenizer())
    assert save_dtype == torch.bfloat16
    real = dict(
        hidden_size=2048,
        num_attention_heads=16,
        num_key_value_heads=2,
        head_dim=256,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        num_experts_per_tok=8,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=512,
        vocab_size=248320,
    )
    assert {k: getattr(config, k) for k in real} == real
    assert config.num_experts == 64 and config.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert round(sum(p.numel() for p in model.parameters()) / 1e9, 2) == 1.46


def test_the_real_4b_size_has_qwen35_4b_dimensions_in_bfloat16():
    """`--size real-4b` (checked without writing its 8.4 GB): Qwen3.5-4B's published text dimensions, built
    with every parameter in bfloat16 from the start (a float32 model would be 17 GB); counted on the meta
    device."""
    import torch
    from transformers import AutoModelForCausalLM

    from hyserve.testing.tiny import SIZES, default_arch, model_config, train_tokenizer

    assert "real-4b" in SIZES and default_arch("real-4b") == "qwen3_5"
    config, save_dtype = model_config("qwen3_5", "real-4b", train_tokenizer())
    assert save_dtype == torch.bfloat16
    real = dict(
        hidden_size=2560,
        intermediate_size=9216,
        num_hidden_layers=32,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=256,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        vocab_size=248320,
        tie_word_embeddings=True,
    )
    assert {k: getattr(config, k) for k in real} == real
    assert config.layer_types == (["linear_attention"] * 3 + ["full_attention"]) * 8
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=save_dtype)  # as hyserve.testing.tiny builds it
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert round(sum(p.numel() for p in model.parameters()) / 1e9, 2) == 4.21


def test_serve_rejects_unsupported_model(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "bert"}')
    r = run("serve", str(tmp_path), "--port", "0")
    assert r.returncode == 2
    assert "not supported" in r.stderr and "qwen3_5" in r.stderr


def test_demo_runs_two_turns(tmp_path):
    r = run("demo", "--cache-dir", str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert "turn 2 usage" in r.stdout and "gibberish" in r.stdout
    turn2 = [l for l in r.stdout.splitlines() if l.startswith("turn 2 usage")][0]
    history = [l for l in r.stdout.splitlines() if l.startswith("turn 2 history_tokens=")][0]
    # the demo waits, like a user reading the reply, so turn 2 reuses the whole history
    assert int(turn2.rsplit("cached_tokens=", 1)[1]) == int(history.split("=")[1].split()[0]) > 0


def test_serve_options_reach_the_checkpoint_policy(tmp_path):
    import argparse

    from hyserve.cli import _add_serve_options, service_config_from_args

    p = argparse.ArgumentParser()
    p.add_argument("model_dir")
    _add_serve_options(p)
    default = service_config_from_args(p.parse_args([str(tmp_path)])).policy
    other = service_config_from_args(p.parse_args([str(tmp_path), "--defer-checkpoints", "--no-system-checkpoint"]))
    assert default.defer_tail == 0 and default.system_prompt  # agents leave no idle time: inline by default
    assert other.policy.defer_tail > 0 and not other.policy.system_prompt


def _config(tmp_path, *argv):
    import argparse

    from hyserve.cli import _add_serve_options, service_config_from_args

    p = argparse.ArgumentParser()
    p.add_argument("model_dir")
    _add_serve_options(p)
    return service_config_from_args(p.parse_args([str(tmp_path), *argv]))


def test_admin_api_key_from_the_flag_or_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv("HYSERVE_ADMIN_API_KEY", raising=False)
    assert _config(tmp_path).admin_api_key is None
    assert _config(tmp_path, "--api-key", "a,b", "--admin-api-key", "root").admin_api_key == "root"
    monkeypatch.setenv("HYSERVE_ADMIN_API_KEY", "from-env")
    assert _config(tmp_path).admin_api_key == "from-env"


def test_special_tokens_in_content_flag(tmp_path):
    assert not _config(tmp_path).allow_special_tokens_in_content
    assert _config(tmp_path, "--allow-special-tokens-in-content").allow_special_tokens_in_content


def test_make_tiny_model_with_a_real_template_and_unknown_parser_names(tmp_path):
    from .conftest import QWEN35_TEMPLATE, real_template

    r = run(
        "make-tiny-model",
        str(tmp_path / "m"),
        "--arch",
        "qwen3",
        "--chat-template",
        str(real_template(QWEN35_TEMPLATE)),
    )
    assert r.returncode == 0, r.stderr
    tok = json.loads((tmp_path / "m" / "tokenizer.json").read_text())
    added = {t["content"]: t["special"] for t in tok["added_tokens"]}
    assert added["<|im_end|>"] and added["<|vision_start|>"] and not added["<think>"] and not added["<tool_call>"]
    template = tmp_path / "m" / "chat_template.jinja"
    config = json.loads((tmp_path / "m" / "tokenizer_config.json").read_text())
    assert "<function=" in (template.read_text() if template.exists() else config["chat_template"])
    r = run("serve", str(tmp_path / "m"), "--port", "0", "--tool-call-parser", "nope")
    assert r.returncode == 2 and "unknown tool-call parser 'nope'" in r.stderr


# -- CLI polish: help and defaults on every flag, --version, bare `hyserve`, human sizes -----------------------


def _subparsers():
    import argparse

    from hyserve.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return parser, sub.choices


def test_every_flag_has_help_and_the_help_shows_defaults():
    parser, commands = _subparsers()
    assert set(commands) == {"serve", "make-tiny-model", "demo", "env"}
    for name, p in commands.items():
        for action in p._actions:
            if action.dest != "help":
                assert action.help, f"hyserve {name} {action.option_strings or action.dest} has no help"
    text = commands["serve"].format_help()
    for shown in (
        "(default: 8000)",
        "(default: 127.0.0.1)",
        "(default: 8M)",
        "(default: 30.0)",
        "(default: info)",
        "25% of RAM",
    ):
        assert shown in text, shown


def test_version_and_bare_hyserve_print_something_useful():
    from hyserve import __version__

    r = run("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"hyserve {__version__}"
    r = run()
    assert r.returncode == 0 and "usage: hyserve" in r.stdout and "make-tiny-model" in r.stdout and not r.stderr


def test_help_never_prints_an_api_key_from_the_environment():
    import os

    r = run(
        "serve",
        "--help",
        env={**os.environ, "HYSERVE_API_KEY": "sk-very-secret", "HYSERVE_ADMIN_API_KEY": "sk-admin-secret"},
    )
    assert r.returncode == 0 and "HYSERVE_API_KEY" in r.stdout and "secret" not in r.stdout


def test_sizes_take_units(tmp_path):
    import argparse

    import pytest

    from hyserve.cli import parse_size

    assert parse_size("8G") == 8 << 30 and parse_size("512m") == 512 << 20 and parse_size("1.5GiB") == 3 << 29
    assert parse_size("64KB") == 64 << 10 and parse_size("1000") == 1000
    for bad in ("", "G", "8X", "-1G", "eight"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_size(bad)
    cfg = _config(tmp_path, "--cache-bytes", "8G", "--max-body-bytes", "1M")
    assert cfg.cache_bytes == 8 << 30 and cfg.max_body_bytes == 1 << 20
    assert _config(tmp_path).max_body_bytes == 8 << 20


def test_kv_sharing_is_on_unless_turned_off(tmp_path):
    assert _config(tmp_path).kv_sharing is True
    assert _config(tmp_path, "--no-kv-sharing").kv_sharing is False


# -- make-tiny-model never writes over, or deletes, what it did not write ------------------------------------------


def test_make_tiny_model_refuses_a_folder_that_holds_files(tmp_path):
    out = tmp_path / "real-model"
    out.mkdir()
    (out / "model-00001-of-00002.safetensors").write_bytes(b"precious weights")
    r = run("make-tiny-model", str(out))
    assert r.returncode == 2 and "not empty" in r.stderr and "--force" in r.stderr and "Traceback" not in r.stderr
    assert sorted(p.name for p in out.iterdir()) == ["model-00001-of-00002.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["real-model"]  # nothing left beside it


def test_make_tiny_model_force_keeps_every_file_it_did_not_write(tmp_path):
    out = tmp_path / "m"
    out.mkdir()
    (out / "model-00001-of-00002.safetensors").write_bytes(b"shard 1")
    (out / "model.safetensors.index.json").write_text("{}")
    (out / "notes.txt").write_text("mine")
    r = run("make-tiny-model", str(out), "--arch", "qwen3", "--force")
    assert r.returncode == 0, r.stderr
    assert (out / "model-00001-of-00002.safetensors").read_bytes() == b"shard 1"
    assert (out / "model.safetensors.index.json").read_text() == "{}" and (out / "notes.txt").read_text() == "mine"
    assert json.loads((out / "config.json").read_text())["model_type"] == "qwen3"
    assert (out / "model.safetensors").stat().st_size > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]  # its temporary folder is gone
    assert "training the tokenizer" in r.stderr and "wrote " in r.stderr  # progress on stderr


# -- start-up checks before any weight is read -------------------------------------------------------------------


def test_serve_checks_the_folder_and_the_port_before_loading(tmp_path, model_dirs):
    import shutil
    import socket

    plain = tmp_path / "no-template"
    shutil.copytree(model_dirs["qwen3"], plain)
    (plain / "chat_template.jinja").unlink(missing_ok=True)
    cfg = json.loads((plain / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (plain / "tokenizer_config.json").write_text(json.dumps(cfg))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = run("serve", str(plain), "--port", str(port), "--device", "cpu")
    assert r.returncode == 2
    assert "no chat template: /v1/chat/completions will answer 400, only /v1/completions" in r.stderr
    assert f"port {port} on 127.0.0.1 is already in use" in r.stderr and "loading" not in r.stderr

    (plain / "model.safetensors").unlink()
    r = run("serve", str(plain), "--port", "0")
    assert r.returncode == 2 and "has no weights" in r.stderr and "Traceback" not in r.stderr


def test_serve_refuses_a_device_torch_cannot_use(model_dirs):
    import pytest
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    r = run("serve", str(model_dirs["qwen3"]), "--port", "0", "--device", "cuda")
    assert r.returncode == 2 and "CUDA is not available" in r.stderr and "--device cpu" in r.stderr
    assert "Traceback" not in r.stderr and "loading" not in r.stderr


def test_serve_refuses_fewer_than_one_replica(model_dirs):
    r = run("serve", str(model_dirs["qwen3"]), "--port", "0", "--replicas", "0")
    assert r.returncode == 2 and "--replicas must be at least 1" in r.stderr and "loading" not in r.stderr


def test_ids_the_tokenizer_lacks_are_never_picked_by_a_real_size_model():
    """A real-size model keeps the real vocabulary over the small tokenizer: the rows of ids the tokenizer has no
    text for are zeroed, so greedy replies are text. Checked on a tiny qwen3 with a 4x vocabulary (tied and not)."""
    import torch
    from transformers import AutoModelForCausalLM

    from hyserve.testing.tiny import model_config, silence_unknown_ids, train_tokenizer

    tokenizer = train_tokenizer()
    known = len(tokenizer)
    config, _ = model_config("qwen3", "tiny", tokenizer)
    for tied in (True, False):
        config.vocab_size, config.tie_word_embeddings = 4 * known, tied
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config)
        ids = torch.randint(0, known, (4, 24))
        assert (model(ids).logits.argmax(-1) >= known).any()  # random rows: ids without text win
        silence_unknown_ids(model, known)
        assert (model(ids).logits.argmax(-1) < known).all()
        assert model.get_output_embeddings().weight[:known].abs().sum() > 0

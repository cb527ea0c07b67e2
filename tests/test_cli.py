"""The console script: make-tiny-model writes a loadable model; demo runs end to end; bad dirs fail clearly."""

import json
import subprocess
import sys


def run(*args, **kw):
    return subprocess.run([sys.executable, "-m", "hyserve.cli", *args], capture_output=True, text=True,
                          timeout=300, **kw)


def test_make_tiny_model(tmp_path):
    r = run("make-tiny-model", str(tmp_path / "m"), "--arch", "mamba2")
    assert r.returncode == 0, r.stderr
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    assert cfg["model_type"] == "mamba2"
    assert (tmp_path / "m" / "tokenizer.json").exists() and list((tmp_path / "m").glob("*.safetensors"))


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
    off = service_config_from_args(p.parse_args([str(tmp_path), "--no-defer-checkpoints", "--no-system-checkpoint"]))
    assert default.defer_tail > 0 and default.system_prompt
    assert off.policy.defer_tail == 0 and not off.policy.system_prompt


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

    r = run("make-tiny-model", str(tmp_path / "m"), "--arch", "qwen3", "--chat-template",
            str(real_template(QWEN35_TEMPLATE)))
    assert r.returncode == 0, r.stderr
    tok = json.loads((tmp_path / "m" / "tokenizer.json").read_text())
    added = {t["content"]: t["special"] for t in tok["added_tokens"]}
    assert added["<|im_end|>"] and added["<|vision_start|>"] and not added["<think>"] and not added["<tool_call>"]
    template = (tmp_path / "m" / "chat_template.jinja")
    config = json.loads((tmp_path / "m" / "tokenizer_config.json").read_text())
    assert "<function=" in (template.read_text() if template.exists() else config["chat_template"])
    r = run("serve", str(tmp_path / "m"), "--port", "0", "--tool-call-parser", "nope")
    assert r.returncode == 2 and "unknown tool-call parser 'nope'" in r.stderr

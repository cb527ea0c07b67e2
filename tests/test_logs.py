"""Log lines: the JSON format carries every field, the text access line reads like uvicorn's, the engine line
reports what actually ran; and the start-up checks word each refusal for the person who typed the command."""

import io
import json
import logging
import socket

import pytest

from hyserve import logs
from hyserve.engine import GenerationRequest
from hyserve.models import preflight
from hyserve.stats_log import StatsLogger


@pytest.fixture
def captured():
    """hyserve's loggers configured as the CLI does, into a buffer; restored after."""
    names = ("", "hyserve", "uvicorn", "uvicorn.error")
    saved = {n: (logging.getLogger(n).handlers[:], logging.getLogger(n).level) for n in names}

    def configure(fmt="text", level="info"):
        buffer = io.StringIO()
        logs.configure(level, fmt, stream=buffer)
        return buffer

    yield configure
    for name, (handlers, level) in saved.items():
        logging.getLogger(name).handlers[:] = handlers
        logging.getLogger(name).setLevel(level)
    logging.getLogger("uvicorn.access").disabled = False
    logging.captureWarnings(False)


def test_access_line_text_and_json(captured):
    fields = {
        "id": "chatcmpl-1",
        "prompt_tokens": 812,
        "cached_tokens": 790,
        "generated_tokens": 64,
        "ttft_s": 0.081,
        "decode_tok_s": 41.2,
        "finish": "stop",
        "duration_s": 1.63,
    }
    text = captured("text")
    logs.log_access("127.0.0.1:5000", "POST", "/v1/chat/completions", "1.1", 200, fields)
    logs.log_access("127.0.0.1:5001", "GET", "/health", "1.1", 200, {"duration_s": 0.001})  # DEBUG: not shown
    (line,) = text.getvalue().splitlines()
    assert line.split(" ", 3)[2:] == [
        "INFO",
        'hyserve.access: 127.0.0.1:5000 - "POST /v1/chat/completions HTTP/1.1" '
        "200 id=chatcmpl-1 prompt_tokens=812 cached_tokens=790 generated_tokens=64 "
        "ttft_s=0.081 decode_tok_s=41.2 finish=stop duration_s=1.63",
    ]

    out = captured("json", "debug")
    logs.log_access("127.0.0.1:5000", "POST", "/v1/chat/completions", "1.1", 200, fields)
    logs.log_access("127.0.0.1:5001", "GET", "/health", "1.1", None, {"duration_s": 0.001})
    chat, health = [json.loads(l) for l in out.getvalue().splitlines()]
    assert {k: chat[k] for k in fields} == fields and chat["status"] == 200 and chat["level"] == "INFO"
    assert chat["logger"] == "hyserve.access" and chat["path"] == "/v1/chat/completions" and "T" in chat["time"]
    assert health["level"] == "DEBUG" and health["status"] is None and '" -' in health["message"]


def test_json_lines_hold_tracebacks_and_other_loggers(captured):
    out = captured("json")
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        logging.getLogger("hyserve.engine").exception("step failed")
    logging.getLogger("uvicorn.error").info("Started server process [1]")
    logging.getLogger("some.library").info("not shown: other libraries from WARNING up")
    failed, started = [json.loads(l) for l in out.getvalue().splitlines()]
    assert failed["level"] == "ERROR" and "RuntimeError: boom" in failed["exc_info"]
    assert started["logger"] == "uvicorn" and started["message"] == "Started server process [1]"


def test_engine_line_reports_the_interval_and_stays_quiet_when_idle(make_service):
    svc = make_service("qwen3_5")
    stats = StatsLogger(svc, interval=0)
    before = stats.sample()
    assert stats.line(before, stats.sample()) is None  # nothing ran
    fin = svc.engine.generate(GenerationRequest(prompt=list(range(5, 45)), max_tokens=6))
    after = stats.sample()
    fields = stats.line(before, after)
    seconds = after["time"] - before["time"]
    assert fields["generation_tok_s"] == round(len(fin.token_ids) / seconds, 1) > 0
    assert fields["prompt_tok_s"] == round(40 / seconds, 1) and fields["cache_hit_rate"] == 0.0
    assert fields["running"] == fields["waiting"] == 0 and fields["cache_budget_bytes"] == 64 << 20
    assert stats.line(after, stats.sample()) is None


def test_model_folder_checks(tmp_path, model_dirs):
    import shutil

    assert preflight.check_model_dir(model_dirs["qwen3_5"]) == []
    with pytest.raises(preflight.StartupError, match="does not exist"):
        preflight.check_model_dir(tmp_path / "nope")
    (tmp_path / "file").write_text("x")
    with pytest.raises(preflight.StartupError, match="is not a folder"):
        preflight.check_model_dir(tmp_path / "file")
    d = tmp_path / "m"
    shutil.copytree(model_dirs["qwen3_5"], d)
    (d / "config.json").write_text("{not json")
    with pytest.raises(preflight.StartupError, match="not valid JSON"):
        preflight.check_model_dir(d)
    shutil.copy(model_dirs["qwen3_5"] / "config.json", d / "config.json")
    for name in preflight.TOKENIZER_FILES:
        (d / name).unlink(missing_ok=True)
    with pytest.raises(preflight.StartupError, match="no tokenizer"):
        preflight.check_model_dir(d)


def test_bind_takes_the_port_and_a_second_bind_is_refused():
    first = preflight.bind("127.0.0.1", 0)
    try:
        port = first.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port), timeout=5):  # listening: connections queue
            pass
        with pytest.raises(preflight.StartupError, match=f"port {port} on 127.0.0.1 is already in use"):
            preflight.bind("127.0.0.1", port)
    finally:
        first.close()
    with pytest.raises(preflight.StartupError, match="cannot resolve"):
        preflight.bind("no-such-host.invalid", 0)

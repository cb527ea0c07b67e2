"""xgrammar against llguidance on this CPU: the numbers hyserve picked its grammar engine by.

For each engine and vocabulary (the tiny test tokenizer, 512 tokens, and a byte-level BPE trained here on
Python sources to 41,607 tokens, the size class of real models' vocabularies; no download): the one-time
tokenizer setup, compiling a JSON schema (a fresh compiler/matcher: no compile cache), the first mask, and
the mean and max time of each next-token mask while the tokens of a valid document are accepted one by
one. Both run in the same process, one after the other, single-threaded where the engine allows it, each
twice (the second run is what a later request pays once process-wide warm-up is done). xgrammar is not a
dependency of hyserve: `pip install --no-deps xgrammar apache-tvm-ffi` to run this.

    python benchmarks/bench_grammar.py            # ~15 s

Run once on 2 shared, busy cores (rough; both engines in the same run, one after the other; llguidance's
mask filled and applied with hyserve's own `grammar` functions, as the server does):

             vocab          engine  setup ms  compile ms  1st mask ms  mask mean us  mask max us
          tiny 512        xgrammar       1.0         0.9         0.38          40.5       3349.3
          tiny 512    xgrammar 2nd       0.9         0.7         0.03           7.2          9.2
          tiny 512      llguidance       6.8         0.7         1.40          20.1         66.3
          tiny 512  llguidance 2nd       2.3         0.5         0.08          31.0       1222.3
         bpe 41607        xgrammar     105.6        15.7         0.22         182.5       4187.3
         bpe 41607    xgrammar 2nd     170.3        12.6         0.22         107.0        171.3
         bpe 41607      llguidance     261.3         1.0         0.39         101.6       1848.5
         bpe 41607  llguidance 2nd     261.6         0.9         0.34          68.5        149.5

At a real vocabulary's size llguidance compiles a schema >10x faster (~1 ms against ~13-16 ms) and masks a
token no slower (~70-100 us against ~110-180 us); its tokenizer setup (once per server) is slower. It also
installs nothing else, where xgrammar pulls apache-tvm-ffi and triton. (llguidance.torch's own mask kernel
is TorchScript, compiled on first use: ~2 s, hence hyserve's plain-torch one.)
    python benchmarks/bench_grammar.py --small    # the tiny tokenizer only
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "address", "active"],
    "additionalProperties": False,
}
DOCUMENT = json.dumps(
    {
        "name": "Ada Lovelace",
        "age": 36,
        "tags": ["math", "engines", "poetry"],
        "address": {"city": "London", "zip": "W1"},
        "active": True,
    }
)


def big_tokenizer(vocab_size: int = 50_000):  # the sources give ~41.6k
    """A byte-level BPE like real models' tokenizers, trained on the Python sources at hand."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    files = sorted(Path(torch.__file__).parent.rglob("*.py"))
    texts, size = [], 0
    for f in files:
        if size > 12_000_000:
            break
        t = f.read_text(errors="ignore")
        texts.append(t)
        size += len(t)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>")


def bench_xgrammar(tok, vocab: int, tokens: list[int]) -> dict:
    import xgrammar as xgr

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)
    setup = time.perf_counter() - t0
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    t0 = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA))
    compile_s = time.perf_counter() - t0
    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    logits = torch.zeros(1, vocab)
    times = []
    for t in tokens:
        t0 = time.perf_counter()
        matcher.fill_next_token_bitmask(bitmask)
        xgr.apply_token_bitmask_inplace(logits, bitmask)
        times.append(time.perf_counter() - t0)
        assert matcher.accept_token(t), f"xgrammar refused token {t}"
    return {"setup": setup, "compile": compile_s, "masks": times}


def bench_llguidance(tok, vocab: int, tokens: list[int]) -> dict:
    import llguidance
    import llguidance.hf

    from hyserve.engine.grammar import apply_bitmask, fill_bitmask, new_bitmask  # as the server does

    t0 = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab)
    setup = time.perf_counter() - t0
    t0 = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))
    matcher = llguidance.LLMatcher(lltok, grammar)
    compile_s = time.perf_counter() - t0
    assert not matcher.is_error(), matcher.get_error()
    bitmask = new_bitmask(vocab)
    logits = torch.zeros(vocab)
    times = []
    for t in tokens:
        t0 = time.perf_counter()
        fill_bitmask(matcher, bitmask)
        apply_bitmask(logits, bitmask)
        times.append(time.perf_counter() - t0)
        assert matcher.consume_token(t), f"llguidance refused token {t}: {matcher.get_error()}"
    return {"setup": setup, "compile": compile_s, "masks": times}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--small", action="store_true")
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    from hyserve.testing.tiny import train_tokenizer

    torch.set_num_threads(1)
    toks = [("tiny", train_tokenizer())]
    if not args.small:
        t0 = time.perf_counter()
        toks.append(("bpe", big_tokenizer()))
        print(f"(trained the BPE tokenizer in {time.perf_counter() - t0:.1f} s)")
    print(
        f"{'vocab':>14} {'engine':>15} {'setup ms':>9} {'compile ms':>11} {'1st mask ms':>12} "
        f"{'mask mean us':>13} {'mask max us':>12}"
    )
    for name, tok in toks:
        vocab = len(tok)
        tokens = tok(DOCUMENT, add_special_tokens=False)["input_ids"]
        for engine, fn in (("xgrammar", bench_xgrammar), ("llguidance", bench_llguidance)):
            for run in ("", " 2nd"):  # the 2nd run: what a later request pays (process-wide warm-up done)
                r = fn(tok, vocab, tokens)
                rest = r["masks"][1:]
                print(
                    f"{name + ' ' + str(vocab):>14} {engine + run:>15} {r['setup'] * 1e3:9.1f} "
                    f"{r['compile'] * 1e3:11.1f} {r['masks'][0] * 1e3:12.2f} "
                    f"{statistics.mean(rest) * 1e6:13.1f} {max(rest) * 1e6:12.1f}"
                )
    print(f"({len(tokens)} tokens per document on the last vocab; numbers under CPU contention are rough)")


if __name__ == "__main__":
    main()

"""Constrained decoding with llguidance: a request's grammar masks its logits before sampling.

llguidance was picked by measurement (benchmarks/bench_grammar.py): it compiles a JSON schema faster than
xgrammar, masks a token no slower, and has no dependencies. `Grammars` (one per service) checks and compiles a request's
constraint on the HTTP side, so a bad schema is a 400; `Constraint` (one per request) holds the matcher, which only
accepted tokens advance.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass

import torch

# JSON is written as json.dumps writes it: free whitespace lets a model pad with spaces and newlines forever.
JSON_DEFAULTS = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}


_BITS = torch.arange(32, dtype=torch.int32)


def new_bitmask(vocab_size: int) -> torch.Tensor:
    return torch.full(((vocab_size + 31) // 32,), -1, dtype=torch.int32)


def fill_bitmask(matcher, bitmask: torch.Tensor) -> None:
    """The matcher's allowed next tokens, one bit each, written into `bitmask` (contiguous int32, CPU)."""
    matcher.unsafe_compute_mask_ptr(bitmask.data_ptr(), bitmask.numel() * bitmask.element_size())


def apply_bitmask(row: torch.Tensor, bitmask: torch.Tensor) -> None:
    """-inf, in place, at every token id whose bit is clear in the bitmask (ids past it too). Plain torch,
    not llguidance.torch: that module compiles a TorchScript kernel on first use (a deprecated API; its time:
    bench_grammar.py)."""
    allowed = ((bitmask.reshape(-1, 1) >> _BITS) & 1).bool().reshape(-1)
    n = min(row.shape[-1], allowed.numel())
    row[n:] = float("-inf")
    row[:n].masked_fill_(~allowed[:n], float("-inf"))


class GrammarError(ValueError):
    """A constraint that cannot be compiled; `param` names the request field (a 400)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Spec:
    """A request's constraint: kind is json (value: schema text), regex, choice (value: JSON list) or grammar
    (Lark with a `start` rule, or GBNF with `root ::=`); `param` is the field it came from."""

    kind: str
    value: str
    param: str


def grammar_text(spec: Spec) -> str:
    """The llguidance grammar for a spec (raises GrammarError for what cannot be read at all)."""
    import llguidance as llg

    if spec.kind == "json":
        return llg.LLMatcher.grammar_from_json_schema(spec.value, defaults=JSON_DEFAULTS)
    if spec.kind == "regex":
        return llg.LLMatcher.grammar_from_regex(spec.value)
    if spec.kind == "choice":
        # Lark string literals take JSON's escapes, so each choice is matched literally
        alts = " | ".join(json.dumps(c) for c in json.loads(spec.value))
        return llg.LLMatcher.grammar_from_lark(f"start: {alts}")
    if spec.kind == "grammar":
        from llguidance.gbnf_to_lark import any_to_lark

        try:
            text = any_to_lark(spec.value)  # Lark as it is (a `start:` rule), GBNF converted
        except Exception as exc:
            raise GrammarError(f"invalid grammar: {exc}", spec.param) from None
        return llg.LLMatcher.grammar_from_lark(text)
    raise GrammarError(f"unknown constraint kind {spec.kind}", spec.param)


class Grammars:
    """The service's grammar side: llguidance's view of the tokenizer (built on first use, which takes a
    while for a large vocabulary: docs/benchmarks.md, bench_grammar.py) and a bounded cache of checked
    grammars, keyed by spec."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids, limit: int = 256):
        self.tokenizer, self.vocab_size, self.eos = tokenizer, vocab_size, sorted(eos_token_ids)
        self.limit = limit
        self._lock = threading.Lock()
        self._lltok = None
        self._checked: dict[Spec, str] = {}

    @property
    def lltok(self):
        with self._lock:
            if self._lltok is None:
                import llguidance.hf

                self._lltok = llguidance.hf.from_tokenizer(
                    self.tokenizer, n_vocab=self.vocab_size, eos_token=self.eos or None
                )
            return self._lltok

    def compile(self, spec: Spec) -> Compiled:
        """Check the spec against the tokenizer: GrammarError (naming the field) when it is invalid."""
        import llguidance as llg

        lltok = self.lltok
        with self._lock:
            text = self._checked.get(spec)
        if text is None:
            try:
                text = grammar_text(spec)
                error = llg.LLMatcher.validate_grammar(text, lltok)
            except GrammarError:
                raise
            except Exception as exc:
                error = str(exc)
            if error:
                raise GrammarError(f"invalid {spec.kind} constraint: {error.strip()[:500]}", spec.param)
            with self._lock:
                if len(self._checked) >= self.limit:
                    self._checked.pop(next(iter(self._checked)))
                self._checked[spec] = text
        return Compiled(lltok, text, self.vocab_size)


@dataclass(frozen=True)
class Compiled:
    """What a GenerationRequest carries: a checked grammar, ready to start a matcher."""

    lltok: object
    text: str
    vocab_size: int
    after: tuple[int, ...] = ()  # tokens (a reasoning block's end tag) the grammar starts after; () from the first

    def start(self) -> Constraint:
        return Constraint(self)


class Constraint:
    """One request's matcher. `mask` the logits before sampling; `accept` the token sampled (or verified)."""

    def __init__(self, compiled: Compiled):
        import llguidance as llg

        self.matcher = llg.LLMatcher(compiled.lltok, compiled.text, log_level=0)
        self.bitmask = new_bitmask(compiled.vocab_size)
        self.waiting = list(compiled.after)  # while set, the reply is still reasoning: nothing constrained
        self.recent: list[int] = []

    def mask(self, logits: torch.Tensor) -> torch.Tensor | None:
        """A copy of a logits row with every token the grammar forbids at -inf (end of sequence only where
        the grammar accepts), or None at a dead end (no token allowed)."""
        if self.waiting:
            return logits
        if self.matcher.is_error():
            return None
        fill_bitmask(self.matcher, self.bitmask)
        if not bool(self.bitmask.any()):
            return None
        row = logits.detach().float().cpu().clone().reshape(-1)  # where the bitmask is (the model's may be a GPU)
        apply_bitmask(row, self.bitmask)
        return row

    def accept(self, token: int) -> bool:
        """Advance by one accepted token; False if the grammar refuses it (the matcher is then in error)."""
        if self.waiting:
            self.recent = (self.recent + [int(token)])[-len(self.waiting) :]
            if self.recent == self.waiting:
                self.waiting = []
            return True
        return bool(self.matcher.consume_token(int(token)))

    def allows(self, logits: torch.Tensor, token: int) -> bool:
        """Whether greedy decoding under the grammar picks `token` here (speculative verify)."""
        masked = self.mask(logits)
        return masked is not None and int(torch.argmax(masked)) == int(token)

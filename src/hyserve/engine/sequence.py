"""The output side of one request: every generated token, decoded or accepted from speculation, goes
through `push`, which owns stop conditions, streaming text, usage counts and latency metrics."""

from __future__ import annotations

import time
from collections.abc import Callable

from .detokenize import IncrementalDetokenizer, StopStringFilter


class OutputSequence:
    def __init__(
        self,
        tokenizer,
        eos_token_ids,
        stop,
        max_tokens: int,
        arrival: float,
        metrics,
        emit: Callable[[str, list[int], list | None], None],
    ):
        self.detok = IncrementalDetokenizer(tokenizer)
        self.stops = StopStringFilter(stop)
        self.eos = eos_token_ids
        self.max_tokens = max_tokens
        self.arrival = arrival
        self.metrics = metrics
        self._emit = emit
        self.generated: list[int] = []
        self.unsent: list[int] = []  # token ids not yet carried by a delta (their text may be held back)
        self.logprobs: list | None = None  # one entry per generated token, when the request asked for them
        self.unsent_logprobs: list = []
        self.text_parts: list[str] = []
        self.ttft: float | None = None
        self._last = None
        self.finish_reason: str | None = None

    def push(self, token: int, logprob=None) -> str | None:
        """Add one generated token (and its logprobs entry, if asked for); return the finish reason if this
        token ends the request."""
        self.generated.append(token)
        self.unsent.append(token)
        if logprob is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.append(logprob)
            self.unsent_logprobs.append(logprob)
        self.metrics.generated_tokens.inc()
        now = time.perf_counter()
        if self.ttft is None:
            self.ttft = now - self.arrival
            self.metrics.ttft.observe(self.ttft)
        else:
            self.metrics.itl.observe(now - self._last)
        self._last = now
        if token in self.eos:
            return self._finish("stop")
        piece = self.stops.feed(self.detok.add(token))
        if piece:
            self.text_parts.append(piece)
            self._send(piece)
        if self.stops.stopped:
            return self._finish("stop")
        if len(self.generated) >= self.max_tokens:
            return self._finish("length")
        return None

    def _finish(self, reason: str) -> str:
        self.finish_reason = reason
        return reason

    def close(self, reason: str | None = None) -> str:
        """Flush held-back text (unless a stop string cut it) and return the full reply text."""
        if reason is not None:
            self.finish_reason = reason
        tail = "" if self.stops.stopped else self.stops.feed(self.detok.flush()) + self.stops.flush()
        if tail or self.unsent:
            self.text_parts.append(tail)
            self._send(tail)
        return "".join(self.text_parts)

    def _send(self, text: str) -> None:
        self._emit(text, self.unsent, self.unsent_logprobs if self.logprobs is not None else None)
        self.unsent, self.unsent_logprobs = [], []

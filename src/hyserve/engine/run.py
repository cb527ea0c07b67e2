"""What the engine keeps per request while serving it (`Run`), and per piece of idle-time work (`Job`)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..cache.manager import Restored
from ..cache.policy import Boundary
from .api import Emit, GenerationRequest
from .logits import Pipeline
from .sampling import Sampler
from .sequence import OutputSequence

log = logging.getLogger("hyserve.engine")
_ending = threading.Lock()  # a run can be ended by the model thread and by the watchdog's


@dataclass
class Run:
    """A request being served: its live state, what is left to prefill, and its output."""

    req: GenerationRequest
    emit: Emit
    boundaries: list[Boundary] = field(default_factory=list)
    deferred: list[Boundary] = field(default_factory=list)  # left to a background job (policy.split_now)
    checkpoint: int = 0  # deepest checkpoint this request restored or recorded: where a later build starts
    restored: Restored | None = None
    out: OutputSequence | None = None
    sampler: Sampler | None = None
    pipeline: Pipeline | None = None  # logits processors applied before the sampler
    proposer: object | None = None
    constraint: object | None = None  # hyserve.engine.grammar.Constraint of a structured-output request
    logits: object | None = None  # next-token logits once prefill is done
    snapshots: int = 0  # checkpoints this request recorded (at most one per distinct boundary)
    spec_misses: int = 0  # verify passes in a row that accepted nothing
    spec_cooldown: int = 0  # decode steps to wait before proposing again
    ended: bool = False  # its final item (Finished or Failed) was emitted
    released: threading.Event = field(default_factory=threading.Event)  # its state and slot are given back

    def end(self, item) -> None:
        """Emit the final item, once: a request that already ended (a watchdog failed it, a cancel raced a
        failure) gets nothing more. Never raises: a failing consumer must not fail anyone else."""
        with _ending:
            if self.ended:
                return
            self.ended = True
        try:
            self.emit(item)
        except Exception:
            log.exception("request %s: emitting its final item failed", self.req.request_id)

    @property
    def state(self):
        return self.restored.state

    @property
    def decoding(self) -> bool:
        return self.logits is not None


@dataclass
class Job:
    """Background work: build the state of `tokens` from the deepest checkpoint, recording each stop."""

    tokens: list[int]
    stops: list[Boundary]  # ascending; the last one may be at len(tokens)
    salt: str
    request_id: str

    def extended_by(self, prompt: Sequence[int], salt: str) -> bool:
        n = len(self.tokens)
        return salt == self.salt and n < len(prompt) and list(prompt[:n]) == self.tokens

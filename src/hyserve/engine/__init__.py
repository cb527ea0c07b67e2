"""The engine, split by phase: `core` (the Engine: public API, worker, the step in order), `admission`,
`prefill`, `decode`, `finishing`, `background` (idle-time jobs), `outbox` (stream delivery), `api` (request
and result types) and `run` (what is kept per running request); and its parts: `scheduler` (admission order),
`sequence` (the per-token output path), `detokenize`, `sampling`, `logits` (bias, penalties, `min_tokens`),
`grammar` (structured outputs) and `speculative` (prompt lookup)."""

from .api import SHUTTING_DOWN, ChatPrompt, Delta, Failed, Finished, GenerationRequest
from .core import Engine
from .scheduler import QueueFull

__all__ = ["SHUTTING_DOWN", "ChatPrompt", "Delta", "Engine", "Failed", "Finished", "GenerationRequest", "QueueFull"]

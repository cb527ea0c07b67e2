"""Where checkpoints are taken. The whole cache policy lives here; the engine only asks.

- history boundary: the prompt rendered for the messages *without* the generation prompt. The next
  turn's prompt starts with exactly these tokens, whatever the model replies, so it always hits.
- system-prompt boundary: the leading system message as every chat that opens with it renders it (cut before
  a user message's opening token: templates such as Qwen3.5's cannot render a system message alone), shared
  by new chats.
- post-decode: prompt + generated tokens, kept only if they are a prefix of the history as the next
  turn will send it (the reply rendered as an earlier message, `next_turn`).
- re-rendered reply: when they are not (templates that drop thinking blocks of earlier turns or trim
  content, non-canonical merges, invalid UTF-8 bytes, reasoning the client does not send back), a job builds
  the state of that history from the deepest checkpoint right after the reply (`engine.background`).
- block grid (a baseline for benchmarks, like vLLM's hybrid cache): only at multiples of `block_size`.

Every boundary is taken inside the prefill that reaches it: captured from the same pass where the adapter can
(Gated DeltaNet models: a snapshot copy, no extra pass), else by splitting the prefill there (one more forward
pass of the tail). Agents send the next request the instant a reply arrives, so no checkpoint may wait for
idle time. `defer_tail` > 0 (opt-in, `--defer-checkpoints`) still leaves a boundary with a short tail close
to the restored state to a job after the reply, saving that pass on models that cannot capture; the next
request waits for that job when it needs it.

Models with no recurrent layers need none of the prefill boundaries: any cached KV cuts to any prefix.
Every boundary is checked to be a strict token prefix of the prompt; if a render fails, that
boundary is skipped and the request is served anyway.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

log = logging.getLogger("hyserve.cache")

DEFER_TAIL = 16  # `--defer-checkpoints`: the tail below which a boundary is left to a job

RenderNextFn = Callable[[list[dict]], list[int]]  # messages ending with the reply -> the next turn's history


def first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    """The first index where `a` and `b` differ (the shorter one's length where one is a prefix)."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


@dataclass(frozen=True)
class Boundary:
    length: int
    kind: str  # "history" | "system" | "block"


@dataclass(frozen=True)
class CheckpointPolicy:
    history_boundary: bool = True
    system_prompt: bool = True
    post_decode: bool = True
    reply_rerender: bool = True
    max_rebuild_tokens: int = 4096  # a re-rendered reply needing more prefill than this is not rebuilt
    block_size: int | None = None  # set: block-grid baseline; the three exact points above are ignored
    defer_tail: int = 0  # >0: a boundary at most this many tokens before the prompt's end is recorded later...
    defer_redo: int = 512  # ...when at most this many tokens separate it from the restored state

    def split_now(self, boundary: Boundary, checkpoint: int, prompt_length: int, busy: bool = False) -> bool:
        """Split the prefill at `boundary` now, or leave it for later (see the module docstring).
        `checkpoint`: the deepest checkpoint this request restored or recorded, where a later build starts;
        `busy`: other requests are running or waiting."""
        if boundary.kind == "block" or busy:  # the baseline splits where vLLM would; busy: no idle time ahead
            return True
        deferrable = prompt_length - boundary.length <= self.defer_tail
        return not (deferrable and boundary.length - checkpoint <= self.defer_redo)

    def wanted_renders(self, messages: list[dict] | None, recurrent: bool) -> list[tuple[str, list[dict]]]:
        """(kind, messages) whose render without the generation prompt may end at a prefill boundary."""
        if self.block_size or not recurrent or not messages:
            return []
        wanted = []
        if self.system_prompt and messages[0].get("role") in ("system", "developer") and len(messages) > 1:
            wanted.append(("system", messages[:1]))
        if self.history_boundary:
            wanted.append(("history", messages))
        return wanted

    def boundaries_from(
        self, prompt: Sequence[int], wanted: list[tuple[str, list[dict]]], rendered: Sequence[list[int] | Exception]
    ) -> tuple[list[Boundary], list[str]]:
        """The boundaries among `rendered` (one result per `wanted` entry) that are strict token prefixes."""
        if self.block_size:
            n = len(prompt)
            return [Boundary(b, "block") for b in range(self.block_size, n, self.block_size)], []
        found: dict[int, Boundary] = {}
        skipped: list[str] = []
        for (kind, _), ids in zip(wanted, rendered, strict=True):
            if isinstance(ids, Exception):  # a template that cannot render this subset: skip, serve the request
                skipped.append(f"{kind}:render_failed:{type(ids).__name__}")
                continue
            if not 0 < len(ids) < len(prompt):
                skipped.append(f"{kind}:not_a_prefix:length")
                continue
            if (diff := first_difference(ids, prompt)) < len(ids):
                skipped.append(f"{kind}:not_a_prefix@{diff}")  # where the render departs from the prompt
                continue
            found.setdefault(len(ids), Boundary(len(ids), kind))
        return sorted(found.values(), key=lambda b: b.length), skipped

    def post_decode_ok(
        self,
        state_tokens: Sequence[int],
        messages: list[dict] | None,
        reply: dict,
        render_next: RenderNextFn,
        recurrent: bool = True,
    ) -> tuple[bool, str, list[int] | None]:
        """Whether to keep the state after decode: it must be a prefix of what the next turn will send
        (`render_next(messages + [reply])`, the reply as an earlier message).

        Returns (keep, reason, the next turn's history ids or None): to rebuild after a reason
        "rerender_mismatch@N" (N: the first token where the state and that history differ), to extend the
        state to after "rerender_match" (its last generated token and the end of the turn are not in it).
        Attention-only states are kept even when the re-render differs (the shared part still truncates),
        and the next turn's history is rebuilt all the same (the KV past the difference is of no use).
        """
        if not self.post_decode or self.block_size:
            return False, "disabled", None
        if not messages:
            return True, "completion", None
        try:
            ids = render_next(messages + [reply])
        except Exception as exc:
            return False, f"render_failed:{type(exc).__name__}", None
        diff = first_difference(state_tokens, ids)
        if diff < len(state_tokens):
            # attention KV past the difference is of tokens no next turn sends: rebuilt like a recurrent state
            rebuild = ids if self.reply_rerender else None
            return (not recurrent), f"rerender_mismatch@{diff}", rebuild
        return True, "rerender_match", ids

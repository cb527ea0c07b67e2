"""The family adapter: how one model family's state is created, advanced, copied and cut back.

The engine, cache and batching only ever talk to a `FamilyAdapter`; each family's file says which of its
layers can be cut back and which exist only at exact checkpoints.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
from transformers import DynamicCache

from ..state import decode_batch, kv_chain
from ..state.caches import clone_cache, set_seen_tokens
from ..state.layer_kinds import kind
from ..state.snapshot import LiveState, Snapshot, token_hash


class FamilyAdapter:
    """How one model family's state is created, advanced, copied and cut back."""

    model_types: ClassVar[tuple[str, ...]] = ()
    # transformers' layer type -> what its cache layer holds (the name of a kind in `state.layer_kinds`): "kv" (cut
    # back to any prefix), "state" (exact only at checkpoints), "both" (one layer holding each), "none".
    state_layers: ClassVar[dict[str, str]] = {}
    has_recurrent_layers: ClassVar[bool] = True
    captures_with_kernels: ClassVar[bool] = False  # `forward_capturing` needs hyserve's kernels
    # The model numbers a piece's tokens from 0 unless told where it starts (transformers' Bamba): pass them.
    explicit_positions: ClassVar[bool] = False
    # The model's multi-token pass ignores a recurrent state it starts from (transformers' Jamba scan): from
    # a non-empty state, run tokens one per pass, the decode path, which does read it.
    one_token_after_start: ClassVar[bool] = False

    def __init__(self, model):
        from ..kernels import KernelReport

        self.model = model
        self.kernels = KernelReport()  # which of hyserve's kernels passed the load-time check (`kernels.install`)
        self._batch = None  # the last decode batch (batching.DecodeBatch), reused while its rows decode on
        self.gathers = 0  # decode batches built afresh (a metric)
        params = inspect.signature(model.forward).parameters
        # transformers 5.24 names it `cache`; keep older names working.
        self._cache_kw = next(k for k in ("cache", "past_key_values", "cache_params") if k in params)

    # -- live state -------------------------------------------------------------------------
    def new_state(self) -> LiveState:
        return LiveState(cache=DynamicCache(config=self.model.config))

    @torch.inference_mode()
    def forward(self, state: LiveState, token_ids: Sequence[int], all_logits: bool = False) -> torch.Tensor:
        """Run `token_ids` into `state` in place; return float logits of the last token ([vocab]) or all
        ([n, vocab])."""
        if not token_ids:
            raise ValueError("forward needs at least one token")
        state.batch = None  # its tensors move on from the batch's rows
        if self.one_token_after_start and state.position and len(token_ids) > 1:
            steps = [self._pass(state, [t], True) for t in token_ids]
            return torch.cat(steps) if all_logits else steps[-1][-1]
        logits = self._pass(state, token_ids, all_logits)
        return logits if all_logits else logits[-1]

    def _pass(self, state: LiveState, token_ids: Sequence[int], all_logits: bool) -> torch.Tensor:
        device = self.model.device
        ids = torch.tensor([list(token_ids)], dtype=torch.long, device=device)
        set_seen_tokens(state.cache, state.position)
        extra = {}
        if self.explicit_positions:
            extra["position_ids"] = torch.arange(state.position, state.position + len(token_ids), device=device)[None]
        out = self.model(
            input_ids=ids,
            use_cache=True,
            logits_to_keep=0 if all_logits else 1,
            **{self._cache_kw: state.cache},
            **extra,
        )
        state.tokens.extend(int(t) for t in token_ids)
        return out.logits[0].float()

    def can_capture(self) -> bool:
        """Whether `forward_capturing` can return states from inside a piece (else split the prefill)."""
        return False

    def forward_capturing(
        self, state: LiveState, token_ids: Sequence[int], offsets: Sequence[int]
    ) -> tuple[torch.Tensor, list[LiveState] | None]:
        """`forward`, also returning the state after each of `offsets` tokens of the piece (ascending, strictly
        inside it), or None when those states could not be had (then no checkpoint may be taken there).
        Their attention KV are views of `state`'s (never written in place: see `clone_cache`); take a
        snapshot before `state` runs on."""
        raise NotImplementedError

    @torch.inference_mode()
    def forward_batch(self, states: Sequence[LiveState], tokens: Sequence[int], room: int = 0) -> torch.Tensor:
        """One decode token for each of several requests in one pass; returns logits [len(states), vocab].
        `room`: requests about to join (in prefill): a batch gathered afresh keeps free rows for them.
        A single request takes this path too: its KV then grows in place, where `forward` would copy the
        whole KV every token (`benchmarks/bench_long_decode.py` measures a step at long context)."""
        batch = self._batch
        rows = decode_batch.place(batch, states, room) if batch is not None else None
        if rows is None:
            self._batch = batch = decode_batch.gather(states, self.model.config, self.model.device, room)
            self.gathers += 1
            rows = list(range(len(states)))
        mask, positions = batch.inputs(self.model.device)
        set_seen_tokens(batch.cache, batch.width)
        ids = torch.zeros((len(batch.owners), 1), dtype=torch.long, device=self.model.device)  # idle rows: token 0
        ids[rows, 0] = torch.tensor([int(t) for t in tokens], dtype=torch.long, device=self.model.device)
        try:
            out = self.model(
                input_ids=ids,
                use_cache=True,
                logits_to_keep=1,
                **{self._cache_kw: batch.cache},
                **self.batch_inputs(mask, positions),
            )
        except BaseException:
            self._batch = None  # half-updated: never reuse it
            for s in states:
                s.batch = None
            raise
        decode_batch.scatter(batch, states, rows, tokens)
        return out.logits[rows, -1].float()

    @property
    def batch_cache(self):
        """The last decode batch's cache (kept between steps), or None."""
        return self._batch.cache if self._batch is not None else None

    def drop_batch(self) -> None:
        """Free the last decode batch's buffers (the engine calls this when nothing is running)."""
        self._batch = None

    def batch_inputs(self, mask: torch.Tensor, positions: torch.Tensor) -> dict:
        """Padding mask and per-row positions for a batch whose attention KV lengths differ."""
        return {"attention_mask": mask, "position_ids": positions}

    # -- snapshot / restore -----------------------------------------------------------------
    def snapshot(self, state: LiveState, base: Snapshot | None = None) -> Snapshot:
        """Compact copies of the state: conv and recurrent state, and its attention KV as a segment
        (`hyserve.state.kv_chain`). With `base`, a checkpoint above this one on its path, the segment holds only
        the tokens after `base` and links to `base`'s chain, provided the state's KV over those tokens is
        bit for bit that chain's; otherwise (and without `base`) it holds the whole KV."""
        return kv_chain.split(
            state.cache, state.position, token_hash(state.tokens), base.kv if base is not None else None
        )

    def restore(self, snapshot: Snapshot, tokens: Sequence[int], length: int | None = None) -> LiveState:
        """A fresh live state equal to `snapshot` (`tokens`: its tokens), or to its first `length` tokens
        (attention-only models); the snapshot itself stays untouched for later requests. Its KV is the
        chain's, concatenated once per layer; a chain of one is shared, not copied: the first forward
        concatenates it into new tensors anyway (see `clone_cache`). Raises KVChainError when the KV does
        not hold exactly the snapshot's tokens, ValueError for a cut of a state that cannot be cut."""
        length = snapshot.num_tokens if length is None else length
        state = LiveState(cache=clone_cache(snapshot.cache, share_kv=True), tokens=list(tokens))
        if length < snapshot.num_tokens and not self.can_truncate(state):
            raise ValueError("this state has recurrent or sliding-window layers and cannot be truncated")
        if snapshot.kv is not None:
            if snapshot.kv.end != snapshot.num_tokens:
                raise kv_chain.KVChainError(f"KV of {snapshot.kv.end} tokens in a snapshot of {snapshot.num_tokens}")
            kv_chain.attach(state.cache, snapshot.kv, length)
            del state.tokens[length:]
        else:
            held = self.attention_length(state)
            if held is not None and held != snapshot.num_tokens:
                raise kv_chain.KVChainError(f"KV of {held} tokens in a snapshot of {snapshot.num_tokens}")
            if length < snapshot.num_tokens:
                self.truncate(state, length)
        return state

    def attention_length(self, state: LiveState) -> int | None:
        """Tokens held by the first full-attention layer, or None when the model has none (pure SSM)."""
        lengths = (kind(layer).kv_length(layer) for layer in state.cache.layers)
        return next((n for n in lengths if n is not None), None)

    # -- truncation -------------------------------------------------------------------------
    def can_truncate(self, state: LiveState) -> bool:
        """True only when every layer can be cut to any shorter prefix exactly (attention KV, or nothing)."""
        return all(kind(layer).trims for layer in state.cache.layers)

    def truncate(self, state: LiveState, num_tokens: int) -> None:
        if not self.can_truncate(state):
            raise ValueError("this state has recurrent or sliding-window layers and cannot be truncated")
        if num_tokens > state.position:
            raise ValueError("cannot truncate to a longer prefix")
        for layer in state.cache.layers:
            kind(layer).cut_kv(layer, num_tokens, copy=True)
        del state.tokens[num_tokens:]
        state.batch = None

    # -- rollback (speculative decoding) --------------------------------------------------
    def rollback_point(self, state: LiveState) -> RollbackPoint:
        """Cheap save before a verify pass: copies of every layer's recurrent state (fixed size), KV only by length."""
        saved = {i: s for i, layer in enumerate(state.cache.layers) if (s := kind(layer).save(layer)) is not None}
        return RollbackPoint(state.position, saved)

    def rewind(self, state: LiveState, point: RollbackPoint, keep: Sequence[int]) -> torch.Tensor | None:
        """Make `state` equal to point + `keep` tokens (which it absorbed, along with rejected ones).

        Attention-only: cut the KV, no compute, returns None. Otherwise restore the saved recurrent
        layers, cut the KV back to the point and re-run `keep`, returning its last logits.
        """
        recurrent = bool(point.saved)
        state.batch = None
        for i, saved in point.saved.items():
            kind(state.cache.layers[i]).put_back(state.cache.layers, i, saved)
        # Views, not copies: the next forward concatenates into a fresh tensor anyway.
        length = point.position if recurrent else point.position + len(keep)
        for layer in state.cache.layers:
            kind(layer).cut_kv(layer, length)
        del state.tokens[length:]
        return self.forward(state, keep) if recurrent and keep else None


@dataclass
class RollbackPoint:
    position: int
    saved: dict[int, object]

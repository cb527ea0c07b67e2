"""Model state per family: run tokens into it, snapshot it, restore it, truncate it where that is exact.

A live state is a transformers `Cache` plus the token ids it has absorbed. What differs between model
families sits in one `FamilyAdapter` subclass each: whether every layer can be cut back to a shorter
prefix (attention KV can; conv + SSM/delta-rule state cannot), and how the model's forward is called.

Like mlx-lm's cache types, each kind of layer says plainly whether it can be trimmed:

=====================  ===========  ==========================================
cache layer            trimmable    saved / restored as
=====================  ===========  ==========================================
DynamicLayer (KV)      yes          copies of keys/values [b, heads, T, d]
LinearAttentionLayer   no           copies of conv + recurrent state (fixed size)
sliding-window KV      no           (old tokens already dropped)
=====================  ===========  ==========================================
"""

from __future__ import annotations

import copy
import hashlib
import inspect
import mmap
import sys
from array import array
from dataclasses import dataclass, field
from typing import ClassVar, Iterable, Sequence

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


def token_hash(tokens: Sequence[int]) -> str:
    """Content hash of a token prefix; stored with each snapshot so a tampered or misfiled one is never used."""
    ids = array("i", tokens)  # int32, as before; 6x faster than per-token to_bytes on a 4k prompt
    if sys.byteorder != "little":
        ids.byteswap()
    h = hashlib.blake2b(digest_size=16)
    h.update(len(tokens).to_bytes(8, "little"))
    h.update(ids.tobytes())
    return h.hexdigest()


def _cache_tensors(cache) -> Iterable[torch.Tensor]:
    for layer in getattr(cache, "layers", [cache]):
        for name in ("keys", "values"):
            t = getattr(layer, name, None)
            if isinstance(t, torch.Tensor):
                yield t
        for name in ("conv_states", "recurrent_states"):
            states = getattr(layer, name, None)
            if isinstance(states, dict):
                yield from (t for t in states.values() if isinstance(t, torch.Tensor))


_ALIGN = 64  # bytes: every tensor of a packed block starts on a cache line


def packed_clones(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Compact copies of CPU `tensors`, all in one block of memory mapped for them alone (and unmapped when
    the last of them goes). A snapshot lives long and comes in many sizes; in the allocator's heap, among
    short-lived activations, snapshots evicted in LRU order left holes that new ones did not fit, and the
    heap grew for as long as a load lasted (`benchmarks/bench_memory.py`). A block of its own per snapshot
    returns to the OS whole when it is evicted. The price is fresh pages for every copy, which fault in
    one by one as it is written (`benchmarks/bench_kernels.py --micro` times it against heap clones)."""
    offsets, total = [], 0
    for t in tensors:
        offsets.append(total)
        total += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
    if total == 0 or not hasattr(mmap, "MAP_ANONYMOUS"):  # (Windows: plain clones)
        return [t.clone() for t in tensors]
    block = mmap.mmap(-1, total, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(block, dtype=torch.uint8)  # keeps `block` alive while any view of it lives
    out = []
    for t, off in zip(tensors, offsets):
        copy_ = raw[off : off + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
        out.append(copy_.copy_(t))
    return out


def clone_cache(cache_or_layer, share_kv: bool = False, packed: bool = False):
    """Deep copy in which every state tensor is a compact clone. A live state in a decode batch holds
    views of its rows; `copy.deepcopy` would copy each view's whole storage, i.e. the whole batch.

    `share_kv`: the copy references the attention KV tensors of plain `DynamicLayer`s instead of cloning
    them. That is safe because such a layer never writes into its tensors: `update` concatenates into
    new ones, `crop` and hyserve's truncation slice or clone (tests/test_state.py checks that a restored
    state's progress leaves its snapshot bit-identical). Conv and recurrent states are updated in
    place, so they are always cloned.

    `packed`: the clones of CPU tensors share one block of their own (`packed_clones`): for snapshots."""
    shared = ({id(t) for layer in getattr(cache_or_layer, "layers", [cache_or_layer]) if type(layer) is DynamicLayer
               for t in (layer.keys, layer.values) if isinstance(t, torch.Tensor)} if share_kv else set())
    tensors = {id(t): t for t in _cache_tensors(cache_or_layer)}  # each once
    cpu = [t for i, t in tensors.items() if packed and i not in shared and t.device.type == "cpu"]
    memo = dict(zip(map(id, cpu), packed_clones(cpu)))
    for i, t in tensors.items():
        if i not in memo:
            memo[i] = t if i in shared else t.clone()
    return copy.deepcopy(cache_or_layer, memo)


def set_seen_tokens(cache, n: int) -> None:
    """Tell `cache` it holds `n` tokens. transformers 5.25 counts tokens in each linear-attention layer
    (`cumulative_length_linear`), and a model whose first layer is one (Qwen3.5) takes its positions and
    mask from that count. hyserve builds, cuts and batches states itself (captured, truncated, rolled
    back, gathered, scattered), so the count is set from the state's own position before every pass
    rather than kept in step by each of those paths. Earlier versions keep no count: a no-op there."""
    for layer in getattr(cache, "layers", ()):
        count = getattr(layer, "cumulative_length_linear", None)
        if isinstance(count, torch.Tensor):
            count.fill_(n)


def cache_nbytes(*caches) -> int:
    """Real bytes held by the caches' tensors (storage size, so a view never under-counts), each storage once
    however many of the caches view it (live states view their decode batch's rows)."""
    seen, total = set(), 0
    for cache in caches:
        for t in _cache_tensors(cache):
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key not in seen:
                seen.add(key)
                total += storage.nbytes()
    return total


@dataclass(frozen=True)
class Snapshot:
    """A standalone copy of the full state after exactly `num_tokens` tokens."""

    cache: object
    num_tokens: int
    prefix_hash: str
    nbytes: int


@dataclass
class LiveState:
    """The state a request is extending, and the exact tokens it has absorbed (its canonical position)."""

    cache: object
    tokens: list[int] = field(default_factory=list)
    batch: int | None = None  # serial of the DecodeBatch whose rows this state's tensors view, while untouched

    @property
    def position(self) -> int:
        return len(self.tokens)


class FamilyAdapter:
    """How one model family's state is created, advanced, copied and cut back."""

    model_types: ClassVar[tuple[str, ...]] = ()
    has_recurrent_layers: ClassVar[bool] = True
    captures_with_kernels: ClassVar[bool] = False  # `forward_capturing` needs hyserve's kernels

    def __init__(self, model):
        from .kernels import KernelReport

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
        """Run `token_ids` into `state` in place; return float logits of the last token ([vocab]) or all ([n, vocab])."""
        if not token_ids:
            raise ValueError("forward needs at least one token")
        device = self.model.device
        ids = torch.tensor([list(token_ids)], dtype=torch.long, device=device)
        state.batch = None  # its tensors move on from the batch's rows
        set_seen_tokens(state.cache, state.position)
        out = self.model(
            input_ids=ids, use_cache=True, logits_to_keep=0 if all_logits else 1, **{self._cache_kw: state.cache}
        )
        state.tokens.extend(int(t) for t in token_ids)
        logits = out.logits[0].float()
        return logits if all_logits else logits[-1]

    def can_capture(self) -> bool:
        """Whether `forward_capturing` can return states from inside a piece (else split the prefill)."""
        return False

    def forward_capturing(self, state: LiveState, token_ids: Sequence[int], offsets: Sequence[int]
                          ) -> tuple[torch.Tensor, list[LiveState] | None]:
        """`forward`, also returning the state after each of `offsets` tokens of the piece (ascending, strictly
        inside it), or None when those states could not be had (then no checkpoint may be taken there).
        Their attention KV are views of `state`'s (never written in place: see `clone_cache`); take a
        snapshot before `state` runs on."""
        raise NotImplementedError

    @torch.inference_mode()
    def forward_batch(self, states: Sequence[LiveState], tokens: Sequence[int]) -> torch.Tensor:
        """One decode token for each of several requests in one pass; returns logits [len(states), vocab].
        A single request takes this path too: its KV then grows in place, where `forward` would copy the
        whole KV every token (bench qwen3_5 at 12k tokens: 13.6 instead of 15.5 ms a step, benchmarks/bench_long_decode.py)."""
        from .batching import gather, place, scatter

        batch = self._batch
        rows = place(batch, states) if batch is not None else None
        if rows is None:
            self._batch = batch = gather(states, self.model.config, self.model.device)
            self.gathers += 1
            rows = list(range(len(states)))
        mask, positions = batch.inputs(self.model.device)
        set_seen_tokens(batch.cache, batch.width)
        ids = torch.zeros((len(batch.owners), 1), dtype=torch.long, device=self.model.device)  # idle rows: token 0
        ids[rows, 0] = torch.tensor([int(t) for t in tokens], dtype=torch.long, device=self.model.device)
        try:
            out = self.model(input_ids=ids, use_cache=True, logits_to_keep=1, **{self._cache_kw: batch.cache},
                             **self.batch_inputs(mask, positions))
        except BaseException:
            self._batch = None  # half-updated: never reuse it
            for s in states:
                s.batch = None
            raise
        scatter(batch, states, rows, tokens)
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
    def snapshot(self, state: LiveState) -> Snapshot:
        """Deep copy of the full state: KV tensors, conv state and recurrent state, never views."""
        cache = clone_cache(state.cache, packed=True)
        return Snapshot(cache, state.position, token_hash(state.tokens), cache_nbytes(cache))

    def restore(self, snapshot: Snapshot, tokens: Sequence[int]) -> LiveState:
        """A fresh live state equal to `snapshot`; the snapshot itself stays untouched for later requests.
        Its attention KV is shared, not copied (see `clone_cache`): the first forward concatenates it
        into new tensors anyway, so a copy here would copy it twice."""
        return LiveState(cache=clone_cache(snapshot.cache, share_kv=True), tokens=list(tokens))

    def attention_length(self, state: LiveState) -> int | None:
        """Tokens held by the first full-attention layer, or None when the model has none (pure SSM)."""
        for layer in state.cache.layers:
            if type(layer) is DynamicLayer:
                return layer.get_seq_length()
        return None

    # -- truncation -------------------------------------------------------------------------
    def can_truncate(self, state: LiveState) -> bool:
        """True only when every layer is plain attention KV, which can be cut to any shorter prefix exactly."""
        return all(type(layer) is DynamicLayer for layer in state.cache.layers)

    def truncate(self, state: LiveState, num_tokens: int) -> None:
        if not self.can_truncate(state):
            raise ValueError("this state has recurrent or sliding-window layers and cannot be truncated")
        if num_tokens > state.position:
            raise ValueError("cannot truncate to a longer prefix")
        for layer in state.cache.layers:
            if layer.keys is not None and layer.keys.numel():
                layer.keys = layer.keys[..., :num_tokens, :].clone()
                layer.values = layer.values[..., :num_tokens, :].clone()
        del state.tokens[num_tokens:]
        state.batch = None


    # -- rollback (speculative decoding) --------------------------------------------------
    def rollback_point(self, state: LiveState) -> "RollbackPoint":
        """Cheap save before a verify pass: copies of every non-KV layer (fixed size), KV only by length."""
        saved = {i: clone_cache(layer) for i, layer in enumerate(state.cache.layers) if type(layer) is not DynamicLayer}
        return RollbackPoint(state.position, saved)

    def rewind(self, state: LiveState, point: "RollbackPoint", keep: Sequence[int]) -> torch.Tensor | None:
        """Make `state` equal to point + `keep` tokens (which it absorbed, along with rejected ones).

        Attention-only: cut the KV, no compute, returns None. Otherwise restore the saved recurrent
        layers, cut the KV back to the point and re-run `keep`, returning its last logits.
        """
        recurrent = bool(point.saved)
        state.batch = None
        for i, layer in point.saved.items():
            state.cache.layers[i] = layer
        # Views, not copies: the next forward concatenates into a fresh tensor anyway.
        length = point.position if recurrent else point.position + len(keep)
        for layer in state.cache.layers:
            if type(layer) is DynamicLayer and layer.keys is not None and layer.keys.numel():
                layer.keys = layer.keys[..., :length, :]
                layer.values = layer.values[..., :length, :]
        del state.tokens[length:]
        return self.forward(state, keep) if recurrent and keep else None


@dataclass
class RollbackPoint:
    position: int
    saved: dict[int, object]


class HybridLinearAttentionAdapter(FamilyAdapter):
    """Gated DeltaNet (linear attention) layers interleaved with full attention: Qwen3.5, Qwen3-Next.

    hyserve's own conv and delta-rule kernels can hand out the state at any token inside a prefill piece
    (`kernels.capture`), so a checkpoint boundary needs no pass of its own. That needs those kernels, which
    run only on the model thread, and only once the load-time check has seen them capture exactly."""

    model_types = ("qwen3_5", "qwen3_5_text", "qwen3_next")
    captures_with_kernels = True

    def can_capture(self) -> bool:
        from . import model_thread

        return self.kernels.on("capture") and model_thread.on_model_thread()

    @torch.inference_mode()
    def forward_capturing(self, state, token_ids, offsets):
        from . import kernels

        start = state.position
        with kernels.capture(len(token_ids), offsets) as cap:
            logits = self.forward(state, token_ids)
        linear = [layer for layer in state.cache.layers if type(layer) is not DynamicLayer]
        complete = (not cap.unexpected and len(cap.conv) == len(cap.recurrent) == len(linear)
                    and all(getattr(layer, "number_of_states", 1) == 1 for layer in linear))
        if not complete:
            return logits, None
        return logits, [self._state_at(state, start + o, [c[i] for c in cap.conv], [r[i] for r in cap.recurrent])
                        for i, o in enumerate(cap.offsets)]

    @staticmethod
    def _state_at(state: LiveState, length: int, conv: list, recurrent: list) -> LiveState:
        """`state`'s cache as it was after `length` tokens: attention KV cut there (views), the captured conv
        and recurrent states in the linear layers (in layer order)."""
        memo: dict[int, object] = {}
        captured = iter(zip(conv, recurrent))
        for layer in state.cache.layers:
            if type(layer) is DynamicLayer:
                memo[id(layer.keys)] = layer.keys[..., :length, :]
                memo[id(layer.values)] = layer.values[..., :length, :]
            else:
                c, r = next(captured)
                memo[id(layer.conv_states[0])], memo[id(layer.recurrent_states[0])] = c, r.to(layer.recurrent_states[0].dtype)
        return LiveState(cache=copy.deepcopy(state.cache, memo), tokens=state.tokens[:length])


class Mamba2Adapter(FamilyAdapter):
    """Pure state-space model: every layer is conv + SSM state; nothing can be truncated."""

    model_types = ("mamba2",)

    def batch_inputs(self, mask, positions) -> dict:
        return {}  # no attention and no positions: fixed-size states stack as they are


class AttentionAdapter(FamilyAdapter):
    """Plain attention models: the KV cache truncates to any prefix."""

    model_types = ("qwen3", "qwen2", "llama")
    has_recurrent_layers = False


ADAPTERS: tuple[type[FamilyAdapter], ...] = (HybridLinearAttentionAdapter, Mamba2Adapter, AttentionAdapter)
SUPPORTED_MODEL_TYPES = tuple(t for a in ADAPTERS for t in a.model_types)


class UnsupportedModelError(ValueError):
    pass


def adapter_for(model) -> FamilyAdapter:
    model_type = model.config.model_type
    for cls in ADAPTERS:
        if model_type in cls.model_types:
            return cls(model)
    raise UnsupportedModelError(
        f"model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
    )

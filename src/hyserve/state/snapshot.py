"""Model state: a live state, its snapshots, and copying, counting and hashing them.

A live state is a transformers `Cache` plus the token ids it has absorbed. What differs between model
families sits in one `FamilyAdapter` subclass each, in `hyserve.families` (re-exported here): whether
every layer can be cut back to a shorter prefix (attention KV can; conv + SSM/delta-rule state cannot),
and how the model's forward is called.

Which kinds of cache layer can be cut back and which exist only at exact checkpoints is said in
`hyserve.state.layer_kinds`.
"""

from __future__ import annotations

import copy
import hashlib
import mmap
import sys
from array import array
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable, Sequence

import torch
from transformers.cache_utils import DynamicLayer

from .snapshot_blocks import BLOCKS

if TYPE_CHECKING:
    from .kv_chain import KVSegment


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
    returns to the OS whole when it is evicted, unless `snapshot_blocks.BLOCKS` keeps it for the next
    snapshot of its size: a block mapped afresh faults its pages in one by one as it is written
    (`benchmarks/bench_kernels.py --micro` times both against heap clones)."""
    offsets, total = [], 0
    for t in tensors:
        offsets.append(total)
        total += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
    if total == 0 or not hasattr(mmap, "MAP_ANONYMOUS"):  # (Windows: plain clones)
        return [t.clone() for t in tensors]
    raw = torch.frombuffer(BLOCKS.take(total), dtype=torch.uint8)  # keeps the block while any view of it lives
    out = []
    for t, off in zip(tensors, offsets):
        copy_ = raw[off : off + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
        out.append(copy_.copy_(t))
    return out


def clone_cache(cache_or_layer, share_kv: bool = False, packed: bool = False, leave_out: Iterable[torch.Tensor] = ()):
    """Deep copy in which every state tensor is a compact clone. A live state in a decode batch holds
    views of its rows; `copy.deepcopy` would copy each view's whole storage, i.e. the whole batch.

    `share_kv`: the copy references the full-attention KV tensors (`_appends_kv`) instead of cloning
    them. That is safe because such a layer never writes into its tensors: `update` concatenates into
    new ones, `crop` and hyserve's truncation slice or clone (tests/test_state.py checks that a restored
    state's progress leaves its snapshot bit-identical). Conv and recurrent states are updated in
    place, so they are always cloned.

    `packed`: the clones of CPU tensors share one block of their own (`packed_clones`): for snapshots.

    `leave_out`: tensors the copy holds None in place of (the KV a snapshot keeps in segments, `kv_chain`)."""
    left = {id(t) for t in leave_out}
    shared = ({id(t) for layer in getattr(cache_or_layer, "layers", [cache_or_layer]) if _appends_kv(layer)
               for t in (layer.keys, layer.values) if isinstance(t, torch.Tensor)} if share_kv else set())
    tensors = {id(t): t for t in _cache_tensors(cache_or_layer) if id(t) not in left}  # each once
    cpu = [t for i, t in tensors.items() if packed and i not in shared and t.device.type == "cpu"]
    memo = dict(zip(map(id, cpu), packed_clones(cpu)))
    for i, t in tensors.items():
        if i not in memo:
            memo[i] = t if i in shared else t.clone()
    memo.update(dict.fromkeys(left))  # deepcopy takes a memo entry of None as the copy: the tensor stays out
    return copy.deepcopy(cache_or_layer, memo)


def _appends_kv(layer) -> bool:
    """Full-attention KV (alone, or beside a recurrent state in a hybrid layer), which `update` only ever
    extends by concatenation: never a sliding window, which drops old tokens."""
    return isinstance(layer, DynamicLayer) and not getattr(layer, "is_sliding", False)


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
    """The full state after exactly `num_tokens` tokens: `cache` holds compact copies of it, except the
    full-attention KV when `kv` is set, which then lives in that chain of segments (`hyserve.state.kv_chain`),
    shared with the checkpoints above it on its tree path."""

    cache: object
    num_tokens: int
    prefix_hash: str
    nbytes: int  # what this snapshot would hold alone: its state part and its whole KV chain
    kv: KVSegment | None = None  # the KV of its last tokens, linked to the KV before them

    @property
    def kv_nbytes(self) -> int:
        """Bytes of its whole KV chain (shared with ancestors: `PrefixTree` counts each segment once)."""
        return self.kv.chain_nbytes if self.kv is not None else 0

    @property
    def state_nbytes(self) -> int:
        """Bytes of what is its own alone: recurrent/conv state, and any KV kept outside segments."""
        return self.nbytes - self.kv_nbytes


@dataclass
class LiveState:
    """The state a request is extending, and the exact tokens it has absorbed (its canonical position)."""

    cache: object
    tokens: list[int] = field(default_factory=list)
    batch: int | None = None  # serial of the DecodeBatch whose rows this state's tensors view, while untouched

    @property
    def position(self) -> int:
        return len(self.tokens)


"""Whole caches: their tensors listed, copied and counted, layer by layer through each layer's kind
(`layer_kinds`)."""

from __future__ import annotations

import copy
import mmap
from collections.abc import Iterable, Iterator, Sequence

import torch

from .layer_kinds import kind
from .snapshot_blocks import BLOCKS


def cache_tensors(cache_or_layer) -> Iterator[torch.Tensor]:
    """Every state tensor of a cache (or of one of its layers)."""
    for layer in getattr(cache_or_layer, "layers", [cache_or_layer]):
        yield from kind(layer).tensors(layer)


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

    `share_kv`: the copy references the full-attention KV tensors (a layer kind's `kv`) instead of cloning
    them. That is safe because such a layer never writes into its tensors: `update` concatenates into
    new ones, `crop` and hyserve's truncation slice or clone (tests/test_state.py checks that a restored
    state's progress leaves its snapshot bit-identical). Conv and recurrent states are updated in
    place, so they are always cloned.

    `packed`: the clones of CPU tensors share one block of their own (`packed_clones`): for snapshots.

    `leave_out`: tensors the copy holds None in place of (the KV a snapshot keeps in segments, `kv_chain`)."""
    left = {id(t) for t in leave_out}
    shared = (
        {id(t) for layer in getattr(cache_or_layer, "layers", [cache_or_layer]) for t in (kind(layer).kv(layer) or ())}
        if share_kv
        else set()
    )
    tensors = {id(t): t for t in cache_tensors(cache_or_layer) if id(t) not in left}  # each once
    cpu = [t for i, t in tensors.items() if packed and i not in shared and t.device.type == "cpu"]
    memo = dict(zip(map(id, cpu), packed_clones(cpu)))
    for i, t in tensors.items():
        if i not in memo:
            memo[i] = t if i in shared else t.clone()
    memo.update(dict.fromkeys(left))  # deepcopy takes a memo entry of None as the copy: the tensor stays out
    return copy.deepcopy(cache_or_layer, memo)


def set_seen_tokens(cache, n: int) -> None:
    """Tell `cache` it holds `n` tokens. transformers 5.25 counts tokens in each linear-attention layer
    (`cumulative_length_linear`), and a model whose first layer is one (Qwen3.5) takes its positions and
    mask from that count. hyserve builds, cuts and batches states itself (captured, truncated, rolled
    back, gathered, scattered), so the count is set from the state's own position before every pass
    rather than kept in step by each of those paths. Earlier versions keep no count: a no-op there."""
    for layer in getattr(cache, "layers", ()):
        kind(layer).set_seen_tokens(layer, n)


def tensors_nbytes(tensors: Iterable[torch.Tensor]) -> int:
    """Real bytes held by `tensors` (storage size, so a view never under-counts), each storage once (a
    segment's tensors share one packed block; live states view their decode batch's rows)."""
    seen, total = set(), 0
    for t in tensors:
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def cache_nbytes(*caches) -> int:
    """Real bytes held by the caches' tensors, each storage once however many of the caches view it."""
    return tensors_nbytes(t for cache in caches for t in cache_tensors(cache))

"""Attention KV stored once along the prefix tree: each checkpoint keeps only the KV of its own new tokens.

A conversation keeps several checkpoints along one path (the system prompt, each history boundary, each
reply). A standalone copy of the state at each would hold all the attention KV before it again and again,
and KV grows with every token where a recurrent state does not: at long contexts it is most of a copy.
Instead a snapshot holds its recurrent/conv state (fixed size) and a `KVSegment`: the KV of the tokens
since the nearest checkpoint above it on the same path, linked to that checkpoint's segment (its
`parent`). Python references keep a segment alive exactly while a checkpoint, a descendant's chain, or a write to the
disk tier still needs it; `PrefixTree` counts each segment's bytes once.

Exactness: a new segment is linked to an ancestor's chain only when the live state's KV over the
ancestor's tokens is bit for bit the chain's (compared as integers: -0.0 differs from 0.0, and a NaN
from a NaN of other bits); otherwise the snapshot stores its whole KV (a chain of one). The usual case
matches, because a restored state's KV is the chain's tensors concatenated and attention KV is only ever
appended to. Segment tensors are never written: `DynamicLayer.update` concatenates into new tensors
(see `caches.clone_cache`).

Which layers: full-attention KV (alone, or beside a recurrent state in a hybrid layer). Sliding-window KV
drops old tokens, so it stays in the snapshot's state part, copied whole, as does any state whose KV
lengths disagree with its token count.
"""

from __future__ import annotations

import copy

import torch

from .caches import cache_nbytes, cache_tensors, clone_cache, packed_clones
from .kv_segment import KV, KVSegment
from .layer_kinds import kind
from .snapshot import Snapshot

MAX_CHAIN = 64  # segments per chain; a deeper checkpoint stores its whole KV (a restore concatenates every piece)


class KVChainError(ValueError):
    """A chain that does not add up to the tokens it claims (a damaged or tampered snapshot): never restored."""


def kv_layers(cache, length: int) -> dict[int, KV] | None:
    """The KV that may live in segments: {layer index: (keys, values)} of every full-attention layer that
    holds it; None when some such layer's KV is not `length` tokens long (then the snapshot keeps it whole)."""
    out = {}
    for i, layer in enumerate(getattr(cache, "layers", ())):
        pair = kind(layer).kv(layer)
        if pair is None:
            continue  # no full-attention KV here (or a layer never run: nothing to keep)
        keys, values = pair
        if keys.dim() < 2 or keys.shape[-2] != length or values.shape[-2] != length:
            return None
        out[i] = (keys, values)
    return out


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
        return False
    bits = _BITS.get(a.element_size())
    if bits is None or a.is_complex():
        return torch.equal(a, b)
    return torch.equal(a.view(bits), b.view(bits))


def extends(kv: dict[int, KV], segment: KVSegment) -> bool:
    """Whether the live KV `kv` begins with exactly the chain ending in `segment`: same layers, and over
    each segment's positions the same bits."""
    for seg in segment.chain():
        if {i for i, pair in enumerate(seg.layers) if pair is not None} != set(kv):
            return False
        for i, (k, v) in kv.items():
            sk, sv = seg.layers[i]
            if k.shape[-2] < seg.end:
                return False
            if not (_same_bits(k[..., seg.start : seg.end, :], sk) and _same_bits(v[..., seg.start : seg.end, :], sv)):
                return False
    return True


def capture(kv: dict[int, KV], end: int, parent: KVSegment | None) -> KVSegment:
    """A segment of positions [parent.end (or 0), end) of `kv`, in compact copies sharing one block."""
    start = parent.end if parent is not None else 0
    order = sorted(kv)
    flat = [t[..., start:end, :] for i in order for t in kv[i]]
    copies = iter(packed_clones(flat))
    layers: list[KV | None] = [None] * (max(order) + 1 if order else 0)
    for i in order:
        layers[i] = (next(copies), next(copies))
    return KVSegment(start, end, tuple(layers), parent)


def assemble(segment: KVSegment, length: int) -> dict[int, KV]:
    """{layer index: (keys, values)} of the chain's first `length` tokens: one concatenation per layer, or
    the segment's own tensors when one whole segment covers them (shared, never copied). Raises
    KVChainError when the chain's pieces do not add up to `length`."""
    chain = segment.chain()
    if not 0 < length <= segment.end:
        raise KVChainError(f"cut at {length} outside a chain of {segment.end} tokens")
    pieces: list[tuple[KVSegment, int]] = []  # (segment, tokens of it used)
    expected = 0
    for seg in chain:
        if seg.start != expected or seg.end <= seg.start:
            raise KVChainError(f"segment [{seg.start}, {seg.end}) does not follow position {expected}")
        expected = seg.end
        if seg.start < length:
            pieces.append((seg, min(seg.end, length) - seg.start))
    layer_ids = [i for i, pair in enumerate(segment.layers) if pair is not None]
    out = {}
    for i in layer_ids:
        ks, vs = [], []
        for seg, n in pieces:
            pair = seg.layers[i] if i < len(seg.layers) else None
            if pair is None or pair[0].shape[-2] != seg.end - seg.start or pair[1].shape[-2] != seg.end - seg.start:
                raise KVChainError(f"layer {i}: segment [{seg.start}, {seg.end}) does not hold its tokens")
            ks.append(pair[0] if n == pair[0].shape[-2] else pair[0][..., :n, :])
            vs.append(pair[1] if n == pair[1].shape[-2] else pair[1][..., :n, :])
        if len(ks) == 1 and ks[0] is pieces[0][0].layers[i][0]:
            out[i] = (ks[0], vs[0])  # one whole segment: share it, as a standalone snapshot's KV always was
        else:
            out[i] = (torch.cat(ks, dim=-2), torch.cat(vs, dim=-2))  # a cut within one segment: compact too
    return out


def attach(cache, segment: KVSegment, length: int) -> None:
    """Put the chain's first `length` tokens of KV into `cache` (a copy of a snapshot's state part)."""
    for i, (k, v) in assemble(segment, length).items():
        layer = cache.layers[i]
        kind(layer).set_kv(layer, k, v)


def split(cache, num_tokens: int, prefix_hash: str, base: KVSegment | None = None, packed: bool = True) -> Snapshot:
    """A snapshot of `cache` after `num_tokens` tokens: its state part in compact copies, and its KV as a
    segment after `base` (the chain of a checkpoint above it) when the KV begins with exactly that chain
    (`extends`), else whole (a chain of one)."""
    kv = kv_layers(cache, num_tokens)
    if not kv:  # no full-attention KV (pure SSM), or KV lengths that disagree: one standalone copy
        state = clone_cache(cache, packed=packed)
        return Snapshot(state, num_tokens, prefix_hash, cache_nbytes(state))
    usable = base is not None and base.depth < MAX_CHAIN and base.end < num_tokens and extends(kv, base)
    segment = capture(kv, num_tokens, base if usable else None)
    state = clone_cache(cache, packed=packed, leave_out=[t for pair in kv.values() for t in pair])
    return Snapshot(state, num_tokens, prefix_hash, cache_nbytes(state) + segment.chain_nbytes, segment)


def adopt(cache, num_tokens: int, prefix_hash: str) -> Snapshot:
    """A snapshot that takes `cache` over as it is (a freshly loaded disk file): its KV becomes a chain of one
    without a copy, the rest its state part."""
    kv = kv_layers(cache, num_tokens)
    if not kv:
        return Snapshot(cache, num_tokens, prefix_hash, cache_nbytes(cache))
    layers: list[KV | None] = [None] * (max(kv) + 1)
    for i, pair in kv.items():
        layers[i] = pair
        kind(cache.layers[i]).set_kv(cache.layers[i], None, None)
    segment = KVSegment(0, num_tokens, tuple(layers), None)
    return Snapshot(cache, num_tokens, prefix_hash, cache_nbytes(cache) + segment.nbytes, segment)


def standalone(snapshot: Snapshot):
    """The snapshot's whole state as one cache (what the disk tier writes): the state part's tensors shared,
    not copied, and the chain's KV assembled."""
    if snapshot.kv is None:
        return snapshot.cache
    memo = {id(t): t for t in cache_tensors(snapshot.cache)}
    cache = copy.deepcopy(snapshot.cache, memo)
    attach(cache, snapshot.kv, snapshot.num_tokens)
    return cache

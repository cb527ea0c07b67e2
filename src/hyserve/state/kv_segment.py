"""A piece of the attention KV a snapshot keeps along the prefix tree (`kv_chain` says why and how)."""

from __future__ import annotations

import torch

from .caches import tensors_nbytes

KV = tuple[torch.Tensor, torch.Tensor]


class KVSegment:
    """The attention KV of positions [start, end), per cache layer (None where a layer has none to share),
    after the KV of `parent` ([0, start)). Never changed once built."""

    __slots__ = ("start", "end", "layers", "parent", "depth", "nbytes", "__weakref__")

    def __init__(self, start: int, end: int, layers: tuple[KV | None, ...], parent: KVSegment | None):
        self.start, self.end, self.layers, self.parent = start, end, layers, parent
        self.depth = parent.depth + 1 if parent is not None else 1
        self.nbytes = tensors_nbytes(t for kv in layers if kv is not None for t in kv)

    def chain(self) -> list[KVSegment]:
        """This segment and its ancestors, the first tokens first."""
        out, seg = [], self
        while seg is not None:
            out.append(seg)
            seg = seg.parent
        return out[::-1]

    @property
    def chain_nbytes(self) -> int:
        return sum(s.nbytes for s in self.chain())

    def __repr__(self) -> str:
        return f"KVSegment([{self.start}, {self.end}), depth={self.depth}, nbytes={self.nbytes})"

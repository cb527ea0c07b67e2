"""Model state: a live state, its snapshots, and the hash that names a token prefix.

A live state is a transformers `Cache` plus the token ids it has absorbed. What differs between model
families sits in one `FamilyAdapter` subclass each, in `hyserve.families`: how the model's forward is
called. What differs between cache layers (whether a layer can be cut back to a shorter prefix: attention
KV can, conv + SSM/delta-rule state cannot) sits in `hyserve.state.layer_kinds`.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field

from .kv_segment import KVSegment


def token_hash(tokens: Sequence[int]) -> str:
    """Content hash of a token prefix; stored with each snapshot so a tampered or misfiled one is never used."""
    ids = array("i", tokens)  # int32, as before; one C-level copy, not a Python call per token (to_bytes)
    if sys.byteorder != "little":
        ids.byteswap()
    h = hashlib.blake2b(digest_size=16)
    h.update(len(tokens).to_bytes(8, "little"))
    h.update(ids.tobytes())
    return h.hexdigest()


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

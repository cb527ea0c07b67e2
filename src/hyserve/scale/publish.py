"""What a replica publishes for routing: for each checkpoint it holds, a salted key of its token prefix and
its length. Kept up to date as snapshots are stored and dropped (`PrefixTree.on_change`), so publishing
is a copy of a dict, never a walk over the tree under the engine's lock.

The key is the snapshot's own content hash (`state.snapshot.token_hash`) hashed again with the tenant's salt: the
router computes the same key from a prompt's tokens, and one tenant's prefixes never match another's."""

from __future__ import annotations

import hashlib
import sys
import threading
from array import array
from collections.abc import Iterable, Sequence

from ..state.snapshot import Snapshot

KEY_BYTES = 8  # 64-bit keys: a collision only misroutes (the replica's restore checks the full hash)


def checkpoint_key(salt: str, prefix_hash: str) -> str:
    """The routing key of a checkpoint whose tokens hash to `prefix_hash` (`token_hash`), in `salt`."""
    return hashlib.blake2b(f"{salt}\0{prefix_hash}".encode(), digest_size=KEY_BYTES).hexdigest()


def prefix_keys(salt: str, tokens: Sequence[int], lengths: Iterable[int]) -> dict[int, str]:
    """{length: key of tokens[:length]} for each length within the prompt; token_hash over one buffer."""
    ids = array("i", tokens)
    if sys.byteorder != "little":
        ids.byteswap()
    raw = memoryview(ids.tobytes())
    out = {}
    for n in lengths:
        if 0 < n <= len(tokens):
            h = hashlib.blake2b(digest_size=16)
            h.update(n.to_bytes(8, "little"))
            h.update(raw[: 4 * n])
            out[n] = checkpoint_key(salt, h.hexdigest())
    return out


class Published:
    """A replica's checkpoints as {key: length}, following its prefix tree."""

    def __init__(self) -> None:
        self._held: dict[str, int] = {}
        self._lock = threading.Lock()  # the engine thread changes it, the replica's event loop reads it
        self.version = 0

    def attach(self, tree) -> None:
        tree.on_change = self.change
        for node, snap in tree.snapshots():
            self.change(tree.salt_of(node), snap, True)

    def change(self, salt: str, snapshot: Snapshot, held: bool) -> None:
        key = checkpoint_key(salt, snapshot.prefix_hash)
        with self._lock:
            if held:
                self._held[key] = snapshot.num_tokens
            else:
                self._held.pop(key, None)
            self.version += 1

    def checkpoints(self) -> list[tuple[str, int]]:
        with self._lock:
            return list(self._held.items())

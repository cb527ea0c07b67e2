"""Moving a checkpoint between replicas instead of recomputing it: when the router sends a conversation
away from the replica holding its deepest checkpoint (that replica is overloaded), the new replica may
fetch the snapshot from it through Ray's object store, if that is cheaper than prefilling the tokens it
covers (bytes over the transfer rate against tokens over the prefill rate).

A package is the disk tier's form (`cache.serialize`: plain tensors and a JSON layout, no pickle of the
cache) with the same fail-closed checks: the model fingerprint, the tenant salt, the token count and content
hash of the prefix, and a checksum over all of them and every tensor byte. A package that fails any check
is refused (an event, nothing stored); one that passes is put into the receiver's prefix tree, where the
request's restore verifies it against the prompt like any other checkpoint."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..cache.fingerprint import fingerprint
from ..cache.serialize import checksum, from_tensors, to_tensors
from ..parsers.registry import template_text
from ..state.kv_chain import adopt, standalone
from ..state.snapshot import token_hash


@dataclass
class Package:
    salt: str
    num_tokens: int
    prefix_hash: str
    fingerprint: str
    layout: str
    checksum: str
    tensors: dict[str, torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def _signed(p: Package) -> tuple[str, ...]:
    return (p.fingerprint, p.salt, str(p.num_tokens), p.prefix_hash, p.layout)


class Transfers:
    """A replica's side of moving checkpoints: packing one it holds, taking one in."""

    def __init__(self, service):
        self.service = service
        rt = service.runtime
        self.fingerprint = fingerprint(rt, template_text(rt.tokenizer))

    def export(
        self, salt: str, tokens: Sequence[int], deeper_than: int = 0, max_bytes: Callable[[int], int] | None = None
    ) -> Package | None:
        """The deepest exact checkpoint of a prefix of `tokens` this replica holds, packed; None when it holds
        none deeper than `deeper_than` tokens, or when its bytes exceed `max_bytes(tokens it saves)` (then
        prefilling them is cheaper for the asker)."""
        cache, rt = self.service.cache, self.service.runtime
        with rt.lock:  # the engine changes the tree while it runs
            match = cache.tree.lookup(tokens, len(tokens), False, salt)
            if match is None or match.length <= deeper_than:
                return None
            snap = match.snapshot  # never changed once stored: packed outside the lock
        tensors, layout = to_tensors(standalone(snap))  # a KV chain joined, as the disk tier writes it
        package = Package(salt, snap.num_tokens, snap.prefix_hash, self.fingerprint, layout, "", tensors)
        if max_bytes is not None and package.nbytes > max_bytes(snap.num_tokens - deeper_than):
            return None
        package.checksum = checksum(tensors, *_signed(package))
        return package

    def take(self, package: Package, salt: str, tokens: Sequence[int], request_id: str = "") -> str:
        """Verify `package` as the checkpoint of `tokens` in `salt` and store it: "stored", or why not."""
        cache, rt = self.service.cache, self.service.runtime
        t0 = time.perf_counter()
        problem = None
        if package.fingerprint != self.fingerprint:
            problem = "fingerprint_mismatch"  # another model, template, dtype or kernel set
        elif package.salt != salt:
            problem = "salt_mismatch"
        elif package.num_tokens != len(tokens) or package.prefix_hash != token_hash(tokens):
            problem = "hash_mismatch"
        elif checksum(package.tensors, *_signed(package)) != package.checksum:
            problem = "checksum_mismatch"
        snap = None
        if problem is None:
            adapter = rt.adapter
            try:
                tensors = {k: t.clone() for k, t in package.tensors.items()}  # own memory, not the transport's
                state = from_tensors(adapter.new_state().cache, tensors, package.layout, adapter.model.device)
                snap = adopt(state, package.num_tokens, package.prefix_hash)  # its KV a chain of one
            except (ValueError, KeyError, TypeError, AttributeError):
                problem = "layout_mismatch"
        base = dict(request_id=request_id, checkpoint_tokens=package.num_tokens, bytes=package.nbytes)
        if problem is not None:
            cache.telemetry.emit("miss", f"replica_{problem}", **base)
            return problem
        with rt.lock:
            stored, reason, evicted = cache.tree.insert(list(tokens), snap, salt)
            cache._evicted(evicted)
        if not stored:
            cache.telemetry.emit("declined", f"replica_load:{reason}", **base)
            return reason
        cache.telemetry.emit("loaded", "replica", load_ms=round((time.perf_counter() - t0) * 1e3, 3), **base)
        return "stored"


def worth_fetching(prefill_tokens_per_s: float, transfer_bytes_per_s: float) -> Callable[[int], int]:
    """tokens -> the most bytes a checkpoint saving that many tokens of prefill may have to be worth moving."""
    return lambda tokens: int(tokens / prefill_tokens_per_s * transfer_bytes_per_s)

"""A radix tree over token ids whose nodes may hold a full state snapshot taken at exactly that depth.

Lookup finds the deepest usable checkpoint for a prompt:
- exact mode (any model with recurrent layers): only a snapshot whose depth is a prefix of the prompt;
- truncate mode (attention-only models): any snapshot below the point where the prompt leaves the tree,
  which the caller cuts back to the match length.

Each cache salt (tenant) has its own root, so one tenant can neither reuse nor time-probe another's
prefixes; the byte budget is shared. Memory is a byte budget over what the snapshots hold: each one's
state part, plus each attention-KV segment once however many snapshots' chains run through it
(`hyserve.state.kv_chain`), so evicting an inner checkpoint whose KV a deeper one still uses frees only its state.
Eviction is least-recently-used among unpinned snapshots, leaves (nothing cached below) before shared
inner prefixes. A pinned snapshot is in use by a request: a clear cannot drop it, so it marks it dead (never
found again, no longer counted as its tenant's) and the last unpin drops it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from ..state.snapshot import Snapshot
from .namespace import tenant_of


class _Node:
    __slots__ = ("edge", "children", "parent", "depth", "snapshot", "pins", "last_used", "dead")

    def __init__(self, edge: tuple[int, ...], parent: _Node | None, depth: int):
        self.edge = edge
        self.children: dict[int, _Node] = {}
        self.parent = parent
        self.depth = depth
        self.snapshot: Snapshot | None = None
        self.pins = 0
        self.last_used = 0
        self.dead = False  # cleared while pinned: dropped at its last unpin, found by nothing meanwhile

    @property
    def usable(self) -> bool:
        return self.snapshot is not None and not self.dead

    def path_tokens(self) -> list[int]:
        parts, node = [], self
        while node is not None:
            parts.append(node.edge)
            node = node.parent
        return [t for edge in reversed(parts) for t in edge]

    def walk(self) -> Iterator[_Node]:
        stack = [self]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())


@dataclass
class Match:
    """A usable checkpoint: restore `snapshot`, cut it to `length` tokens if shorter, prefill the rest."""

    node: _Node
    snapshot: Snapshot
    length: int

    @property
    def needs_truncation(self) -> bool:
        return self.length < self.snapshot.num_tokens


class PrefixTree:
    def __init__(self, budget_bytes: int):
        self.budget_bytes = budget_bytes
        self.roots: dict[str, _Node] = {"": _Node((), None, 0)}
        self.state_bytes = 0  # snapshots' own parts: recurrent/conv state (and KV kept outside segments)
        self.kv_bytes = 0  # attention-KV segments, each once
        self._segments: dict[int, list] = {}  # id -> [segment, holders]: snapshots with it as tail, held children
        self.entries = 0
        self.dead = 0  # of `entries`: cleared while pinned, their bytes held until their last unpin
        self._clock = itertools.count(1)
        self.on_evict: Callable[[str, Snapshot], None] | None = None  # (salt, snapshot) of each budget eviction
        # (salt, snapshot, held) whenever a snapshot is stored (True) or dropped for any reason (False):
        # what a replica publishes for routing (hyserve.scale.publish) follows the tree through it
        self.on_change: Callable[[str, Snapshot, bool], None] | None = None

    @property
    def total_bytes(self) -> int:
        return self.state_bytes + self.kv_bytes

    @property
    def root(self) -> _Node:
        return self.roots[""]

    def _root(self, salt: str) -> _Node:
        if salt not in self.roots:
            self.roots[salt] = _Node((), None, 0)
        return self.roots[salt]

    def _all_nodes(self) -> Iterator[_Node]:
        for root in list(self.roots.values()):
            yield from root.walk()

    # -- lookup ----------------------------------------------------------------------------
    def _descend(self, tokens: Sequence[int], salt: str = "") -> tuple[list[_Node], int, _Node | None]:
        """Nodes fully matched along `tokens`, the matched length, and the child entered part-way (if any)."""
        root = self.roots.get(salt) or _Node((), None, 0)
        node, pos, path = root, 0, [root]
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                return path, pos, None
            n = _common_len(child.edge, tokens, pos)
            if n < len(child.edge):
                return path, pos + n, child
            node, pos = child, pos + n
            path.append(node)
        return path, pos, None

    def lookup(self, tokens: Sequence[int], max_length: int, truncate: bool, salt: str = "") -> Match | None:
        """Deepest checkpoint usable for a prompt, using at most `max_length` of its tokens."""
        tokens = tokens[:max_length]
        path, matched, partial = self._descend(tokens, salt)
        if truncate and matched > 0:
            start = partial if partial is not None else path[-1]
            # the shallowest snapshot below the divergence point: least to copy and cut away
            best = min((n for n in start.walk() if n.usable), key=lambda n: n.depth, default=None)
            if best is not None:
                return self._touch(Match(best, best.snapshot, matched))
        for node in reversed(path):
            if node.usable and node.depth > 0:
                return self._touch(Match(node, node.snapshot, node.depth))
        return None

    def _touch(self, match: Match) -> Match:
        match.node.last_used = next(self._clock)
        return match

    def has(self, tokens: Sequence[int], salt: str = "") -> bool:
        path, matched, partial = self._descend(tokens, salt)
        return partial is None and matched == len(tokens) and path[-1].usable

    # -- insert / evict --------------------------------------------------------------------
    def insert(self, tokens: Sequence[int], snapshot: Snapshot, salt: str = "") -> tuple[bool, str, list[Snapshot]]:
        """Store `snapshot` at depth len(tokens). Returns (stored, reason, evicted snapshots)."""
        if snapshot.num_tokens != len(tokens):
            return False, "token_count_mismatch", []
        if snapshot.nbytes > self.budget_bytes:
            return False, "over_budget", []
        node = self._make_path(tokens, self._root(salt))
        if node.dead:  # recorded again after a clear: the new snapshot takes the dead one's place
            self._release(node.snapshot)
            self.entries, self.dead = self.entries - 1, self.dead - 1
            node.snapshot, node.dead = None, False
        if node.snapshot is not None:
            return False, "duplicate", []
        node.snapshot = snapshot
        node.last_used = next(self._clock)
        self._hold(snapshot)
        self.entries += 1
        if self.on_change is not None:
            self.on_change(salt, snapshot, True)
        evicted = self._evict(keep=node)
        return True, "recorded", evicted

    def _hold(self, snapshot: Snapshot) -> None:
        """Count `snapshot`'s bytes: its state, and the segments of its chain not yet held by another."""
        self.state_bytes += snapshot.state_nbytes
        seg = snapshot.kv
        while seg is not None:
            entry = self._segments.get(id(seg))
            if entry is not None:
                entry[1] += 1
                return
            self._segments[id(seg)] = [seg, 1]
            self.kv_bytes += seg.nbytes
            seg = seg.parent

    def _release(self, snapshot: Snapshot) -> None:
        """Uncount `snapshot`: its state, and each segment of its chain nothing else holds any more."""
        self.state_bytes -= snapshot.state_nbytes
        seg = snapshot.kv
        while seg is not None:
            entry = self._segments[id(seg)]
            entry[1] -= 1
            if entry[1]:
                return
            del self._segments[id(seg)]
            self.kv_bytes -= seg.nbytes
            seg = seg.parent

    def base_for(self, tokens: Sequence[int], salt: str = "") -> Snapshot | None:
        """The deepest snapshot above depth len(tokens) on the path of `tokens`: whose KV chain a snapshot
        there may continue."""
        path, _, _ = self._descend(tokens, salt)
        return next((n.snapshot for n in reversed(path) if n.usable and 0 < n.depth < len(tokens)), None)

    def _make_path(self, tokens: Sequence[int], root: _Node) -> _Node:
        node, pos = root, 0
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                new = _Node(tuple(tokens[pos:]), node, len(tokens))
                node.children[tokens[pos]] = new
                return new
            n = _common_len(child.edge, tokens, pos)
            if n < len(child.edge):  # split the edge at the divergence point
                mid = _Node(child.edge[:n], node, node.depth + n)
                node.children[tokens[pos]] = mid
                child.edge = child.edge[n:]
                child.parent = mid
                mid.children[child.edge[0]] = child
                child = mid
            node, pos = child, pos + n
        return node

    def _evict(self, keep: _Node | None = None) -> list[Snapshot]:
        evicted = []
        while self.total_bytes > self.budget_bytes:
            candidates = [n for n in self._all_nodes() if n.snapshot is not None and n.pins == 0 and n is not keep]
            if not candidates:
                break
            victim = min(candidates, key=lambda n: (_has_snapshot_below(n), n.last_used))
            salt = self.salt_of(victim)
            evicted.append(self._drop(victim))
            if self.on_evict is not None:
                self.on_evict(salt, evicted[-1])
        return evicted

    def salt_of(self, node: _Node) -> str:
        while node.parent is not None:
            node = node.parent
        return next((salt for salt, root in self.roots.items() if root is node), "")

    def remove(self, node: _Node) -> Snapshot | None:
        return self._drop(node) if node.snapshot is not None else None

    def _drop(self, node: _Node) -> Snapshot:
        if node.dead:  # (reported gone when it died)
            self.dead -= 1
        elif self.on_change is not None:
            self.on_change(self.salt_of(node), node.snapshot, False)
        snap, node.snapshot, node.dead = node.snapshot, None, False
        self._release(snap)
        self.entries -= 1
        self._prune(node)
        return snap

    def _prune(self, node: _Node) -> None:
        """Remove empty leaves and merge single-child inner nodes so the tree stays small."""
        while node.parent is not None and node.snapshot is None and node.pins == 0:
            parent = node.parent
            if not node.children:
                del parent.children[node.edge[0]]
            elif len(node.children) == 1:
                (child,) = node.children.values()
                child.edge = node.edge + child.edge
                child.parent = parent
                parent.children[node.edge[0]] = child
            else:
                return
            node = parent

    def _salts(self, tenant: str | None) -> list[str]:
        return [s for s in self.roots if tenant is None or tenant_of(s) == tenant]

    def clear(self, tenant: str | None = None) -> int:
        """Drop every snapshot, or only those of `tenant`'s salts; a pinned one dies (see the module's doc)."""
        removed = 0
        for salt in self._salts(tenant):
            for node in list(self.roots[salt].walk()):
                if not node.usable:
                    continue
                removed += 1
                if node.pins == 0:
                    self._drop(node)
                else:
                    node.dead, self.dead = True, self.dead + 1
                    if self.on_change is not None:
                        self.on_change(salt, node.snapshot, False)
            if salt and not self.roots[salt].children:  # an emptied request salt keeps no root
                del self.roots[salt]
        return removed

    def usage(self, tenant: str | None = None) -> tuple[int, int]:
        """(entries, bytes) held by all salts, or by `tenant`'s."""
        entries, state, kv = self.usage_split(tenant)
        return entries, state + kv

    def usage_split(self, tenant: str | None = None) -> tuple[int, int, int]:
        """(entries, state bytes, KV segment bytes) held by all salts, or by `tenant`'s (chains never
        cross salts: a snapshot continues only a checkpoint of its own salt's tree). Dead checkpoints are no
        one's: not counted (the byte budget counts what memory holds, theirs included)."""
        if tenant is None and not self.dead:
            return self.entries, self.state_bytes, self.kv_bytes
        entries = state = 0
        segments = {}
        for salt in self._salts(tenant):
            for node in self.roots[salt].walk():
                if node.usable:
                    entries, state = entries + 1, state + node.snapshot.state_nbytes
                    seg = node.snapshot.kv
                    while seg is not None and id(seg) not in segments:
                        segments[id(seg)] = seg.nbytes
                        seg = seg.parent
        return entries, state, sum(segments.values())

    # -- pins ------------------------------------------------------------------------------
    def pin(self, node: _Node) -> None:
        node.pins += 1

    def unpin(self, node: _Node) -> list[Snapshot]:
        node.pins -= 1
        if node.pins == 0 and node.dead:
            self._drop(node)
        elif node.pins == 0 and node.snapshot is None:
            self._prune(node)
        return self._evict()

    def snapshots(self) -> Iterator[tuple[_Node, Snapshot]]:
        for node in self._all_nodes():
            if node.usable:
                yield node, node.snapshot


def _common_len(edge: tuple[int, ...], tokens: Sequence[int], pos: int) -> int:
    """Length of the common start of `edge` and `tokens[pos:]`. Slices compare in C: a whole-edge match
    (the usual case, a 4k-token history) is one comparison, a divergence is found by bisection."""
    limit = min(len(edge), len(tokens) - pos)
    if tuple(tokens[pos : pos + limit]) == edge[:limit]:
        return limit
    lo, hi = 0, limit  # edge[:lo] matches, edge[:hi] does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if tuple(tokens[pos + lo : pos + mid]) == edge[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def _has_snapshot_below(node: _Node) -> bool:
    return any(n.snapshot is not None for child in node.children.values() for n in child.walk())

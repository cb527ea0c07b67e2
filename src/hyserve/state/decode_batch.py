"""Batched decode over requests that each own a live state: one token from each in a single forward
pass.

Recurrent layers (conv + SSM / delta-rule state) have a fixed size, so gathering them is a
concatenation along the batch dimension. Attention KV differs in length per request: it is
left-padded to the longest, masked out with an attention mask, and every row gets its own position.
A hybrid layer (both in one layer: Falcon-H1, Zamba2) gets both; a layer with no state (an MoE or MLP
layer of Nemotron-H) nothing. What a layer holds is its kind (`state.layer_kinds`).

The batched cache outlives the step (`DecodeBatch`). After a pass each request's state becomes a set
of views of its own row, so nothing is copied back; when the next step decodes requests whose rows
are untouched since, the same batched cache runs again with no gathering at all. A finished request
frees its row and a joining one is copied into a free row when its KV fits the batch's width, so a
request coming and going costs a copy of its own state, not of everyone's (`place`). A free row
decodes a dummy token over its own old state until a joining request takes it. The batch is gathered
afresh from the requests' states when that is not possible or not worth it (see `place`). Gathering
copies every request's state: at 16 requests of 1k tokens about as long as the pass itself, and
under short replies requests join or leave at almost every step. The batch's attention layers also
keep spare columns (`batch_layers`), so a step writes its token in place where `DynamicLayer.update` would
concatenate (copy) the whole batch.

A state that holds views never leaks the batch: snapshots and rollback points copy only the view's
own elements (`caches.clone_cache`), and any per-request forward, rewind or truncation marks the state
as no longer in the batch.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Sequence

import torch
from transformers import DynamicCache

from . import batch_layers
from .layer_kinds import kind
from .snapshot import LiveState


class DecodeBatch:
    """The batched cache of the last decode pass, and which states (and positions) it holds.

    Neither side holds the other: a state carries only the batch's serial number and the batch only
    weak references to the states, so no reference cycle keeps a finished request's rows (or an old
    batch's buffers) alive until the cyclic garbage collector happens to run."""

    _serials = itertools.count(1)

    def __init__(self, cache: DynamicCache, states: Sequence[LiveState], pads: list[int], free: int = 0):
        self.cache = cache
        self.serial = next(self._serials)
        # The state in each row. Weak: a finished request's state goes at once, and its row is then free.
        self.owners: list[weakref.ref | None] = [weakref.ref(s) for s in states] + [None] * free
        self.pads = pads  # left padding of each row in the attention KV
        # tokens in each row (a free row's keep counting; one gathered free holds none, all padding)
        self.positions = [s.position for s in states] + [0] * free

    @property
    def width(self) -> int:
        """Columns of the attention KV: every row's padding plus its tokens comes to this."""
        return max(p + n for p, n in zip(self.pads, self.positions))

    def inputs(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention mask for one more token per row, and each row's position."""
        width = self.width + 1
        mask = torch.zeros(len(self.owners), width, dtype=torch.long, device=device)
        for i, p in enumerate(self.pads):
            mask[i, p:] = 1
        positions = torch.tensor(self.positions, dtype=torch.long, device=device).view(-1, 1)
        return mask, positions


def gather(states: Sequence[LiveState], config, device, room: int = 0) -> DecodeBatch:
    """A batched cache of `states` (copies; the states are left as they are), with `room` free rows more (zero
    states, all padding) for requests that are about to join: each then copies only its own state into one
    (`place`), where a batch gathered without them would be gathered afresh as each joins."""
    lengths = [s.position for s in states]
    longest = max(lengths)
    batch = DynamicCache(config=config)
    for li, layer in enumerate(batch.layers):
        rows = [s.cache.layers[li] for s in states]
        batch.layers[li] = kind(rows[0]).batch_layer(layer, rows, longest, room)
    return DecodeBatch(batch, states, [longest - n for n in lengths] + [longest] * room, free=room)


def place(batch: DecodeBatch, states: Sequence[LiveState], room: int = 0) -> list[int] | None:
    """The row of each of `states` in `batch`, or None when the batch should be gathered afresh instead.

    A state untouched since the last pass keeps its row. One that ran a pass of its own (speculation) is
    copied back into its own row: its conv and recurrent states may still view that row, so no other
    request may have it. A joining request is copied into a row whose state is gone (its request
    finished). Gathered afresh when a state still alive is not among `states` (a pass updates every
    row's conv and recurrent states in place, which that state may view), when a joining request's KV
    is longer than the batch is wide or no row is free for it, when more than a quarter of the rows
    would idle (beyond `room`, the rows kept for requests about to join), or when more than a third of the batch's width
    (and more than SPARE columns) is left padding in every row. Every row is right-aligned at the width, which grows by
    one column a pass, so under a steady load, where requests keep joining the rows of finished ones and the batch is
    never gathered for another reason, the width would grow without end: the batch's memory and every pass's
    attention with it (`benchmarks/bench_load.py`'s soak shows whether it stays bounded)."""
    owners = [ref() if ref is not None else None for ref in batch.owners]
    row_of = {id(o): r for r, o in enumerate(owners) if o is not None}
    if row_of.keys() - {id(s) for s in states}:
        return None
    rows: list[int | None] = [None] * len(states)
    back: dict[int, int] = {}  # index in `states` -> own row, for states that ran a pass of their own
    for i, s in enumerate(states):
        r = row_of.get(id(s))
        if r is not None:
            if s.batch == batch.serial and s.position == batch.positions[r]:
                rows[i] = r
            else:
                back[i] = r
    joining = [i for i, r in enumerate(rows) if r is None]
    free = [r for r, o in enumerate(owners) if o is None]
    if len(joining) - len(back) > len(free) or len(owners) - len(states) > max(len(states) // 4, room):
        return None
    attention = any(kind(layer).kv(layer) is not None for layer in batch.cache.layers)
    width = batch.width
    if attention and any(states[i].position > width for i in joining):
        return None  # its KV is longer than the batch's: gather afresh, wider
    if attention and width - max(s.position for s in states) > max(batch_layers.SPARE, width // 3):
        return None  # columns that only finished requests used: gather afresh, narrower
    free.reverse()
    for i in joining:
        rows[i] = back[i] if i in back else free.pop()
        _copy_into_row(batch, rows[i], states[i])
    return rows


def _copy_into_row(batch: DecodeBatch, row: int, state: LiveState) -> None:
    """Write `state` into `row` of the batch: its attention KV right-aligned at the batch's width (zeros to
    the left: masked, and a masked value must not be a NaN), its conv and recurrent states as they are."""
    width = batch.width
    pad = width - state.position
    for layer, own in zip(batch.cache.layers, state.cache.layers):
        kind(layer).write_row(layer, row, own, pad, width)
    batch.owners[row], batch.pads[row], batch.positions[row] = weakref.ref(state), pad, state.position


def scatter(batch: DecodeBatch, states: Sequence[LiveState], rows: Sequence[int], tokens: Sequence[int]) -> None:
    """After a pass: every state becomes views of its own row of the batched cache (no copies)."""
    for li, layer in enumerate(batch.cache.layers):
        for i, state in zip(rows, states):
            kind(layer).view_row(layer, i, state.cache.layers[li], batch.pads[i])
    for state, token in zip(states, tokens):
        state.tokens.append(int(token))
        state.batch = batch.serial
    batch.positions = [n + 1 for n in batch.positions]  # every row, free ones too, took one token

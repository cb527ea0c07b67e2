"""States from inside a prefill piece: the conv and delta-rule kernels hand out the state at given
offsets of the piece while it runs, so a checkpoint there costs no pass of its own."""

from __future__ import annotations

import contextlib
import threading

import torch


class PieceCapture:
    """The recurrent state of every Gated DeltaNet layer after `offsets` tokens of one prefill piece of
    `length` tokens (batch 1), collected while the piece runs, so a checkpoint inside the piece costs no
    pass of its own. The conv kernel sees the layer's previous conv state followed by the piece
    (transformers' `update_conv_state`), so the window before each offset is the conv state there; the
    delta rule runs once per stretch between offsets, from the state the stretch before ended in, which is
    the state there. `conv` and `recurrent` get one list (a tensor per offset) per layer, in layer order."""

    def __init__(self, length: int, offsets):
        self.length = length
        self.offsets = tuple(offsets)
        if not all(a < b for a, b in zip((0, *self.offsets), (*self.offsets, length))):
            raise ValueError(f"capture offsets must ascend strictly inside the piece: {offsets} of {length}")
        self.conv: list[list[torch.Tensor]] = []
        self.recurrent: list[list[torch.Tensor]] = []
        self.unexpected = 0  # kernel calls during the capture that did not fit the piece


_CAPTURE = threading.local()


@contextlib.contextmanager
def capture(length: int, offsets):
    """Collect a `PieceCapture` while a forward pass of one `length`-token piece runs on this thread."""
    cap = PieceCapture(length, offsets)
    _CAPTURE.current = cap
    try:
        yield cap
    finally:
        _CAPTURE.current = None


def capture_for(x: torch.Tensor, seq_dim: int = 1) -> PieceCapture | None:
    """The capture in progress on this thread, if `x` (batch 1) can be one of its piece's layers: the delta
    rule's input holds exactly the piece's tokens (`seq_dim` 1), the conv's (`seq_dim` -1) the piece after
    the previous conv state or padding, so at least as many."""
    cap = getattr(_CAPTURE, "current", None)
    if cap is None:
        return None
    n = x.shape[seq_dim]
    if x.shape[0] != 1 or n < cap.length or (seq_dim == 1 and n != cap.length):
        cap.unexpected += 1  # the pass is not what the capture was set up for: it yields no states
        return None
    return cap

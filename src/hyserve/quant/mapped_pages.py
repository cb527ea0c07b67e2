"""A checkpoint's safetensors files opened as transformers opens them (memory-mapped), with each tensor's pages
dropped from the process once the tensor read from them is gone.

safetensors maps a file privately and a tensor read from it is a view of the mapping: the pages read stay resident,
counted in the process's RSS, until the whole file is unmapped at the end of the load, so a load that quantizes
as it goes would still peak at the whole checkpoint's size (float32 files: twice the bfloat16 model). Here a
tensor's pages (those wholly inside it) are handed back with madvise(MADV_DONTNEED) when the view dies: they were
never written (a private mapping's pages are copied on a write, and nothing writes into a tensor being loaded),
so a later read faults the file's own bytes in again from the page cache. Once the files are closed nothing is
dropped any more (a parameter that is such a view stays mapped).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import mmap
import struct
import weakref
from pathlib import Path

from ..allocator import libc_function

MADV_DONTNEED = 4  # <sys/mman.h>


def _madvise():
    fn = libc_function("madvise")
    if fn is not None:
        fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


def data_offsets(path: Path) -> dict[str, int]:
    """Where each tensor's bytes start in a safetensors file (its header: 8 bytes of length, then JSON)."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    return {k: 8 + length + v["data_offsets"][0] for k, v in header.items() if k != "__metadata__"}


class _Files:
    """The open files, where each tensor of theirs is mapped, and whether they are still open."""

    def __init__(self, files: list[Path]):
        from safetensors import safe_open

        self.madvise = _madvise()
        self.handles = [safe_open(str(f), framework="pt", device="cpu") for f in files]
        self.addresses: dict[str, int] = {}  # a tensor's name -> the address of its bytes in its file's mapping
        for path, handle in zip(files, self.handles):
            offsets = data_offsets(path)
            if offsets:  # the mapping's start, from any of its tensors
                key = next(iter(offsets))
                base = handle.get_slice(key)[...].data_ptr() - offsets[key]
                self.addresses.update((k, base + at) for k, at in offsets.items())
        self.open = True

    def drop(self, start: int, end: int) -> None:
        """Hand back the pages wholly inside [start, end) of a mapping, while the files are open."""
        page = mmap.PAGESIZE
        start, end = -(-start // page) * page, end // page * page
        if self.open and end > start:
            self.madvise(start, end - start, MADV_DONTNEED)

    def close(self) -> None:
        self.open = False
        for handle in self.handles:
            handle.__exit__(None, None, None)


class _Slice:
    """A safetensors slice whose full read (`[...]`, what transformers reads) drops its pages when it is gone."""

    def __init__(self, inner, name: str, files: _Files):
        self.inner, self.name, self.files = inner, name, files

    def __getitem__(self, index):
        tensor = self.inner[index]
        start = tensor.data_ptr()
        # only a view of the mapping where this tensor's bytes are, never memory of the process's own
        if index is Ellipsis and tensor.is_contiguous() and start == self.files.addresses.get(self.name):
            weakref.finalize(tensor, self.files.drop, start, start + tensor.numel() * tensor.element_size())
        return tensor

    def __getattr__(self, name):  # get_shape, get_dtype, ...
        return getattr(self.inner, name)


@contextlib.contextmanager
def released(files: list[Path] | None):
    """A state dict (name -> slice) over `files` for `from_pretrained(state_dict=...)`, each tensor's pages
    dropped once it is gone; None for None (or where there is no madvise), so the caller loads its usual way."""
    if files is None or _madvise() is None:
        yield None
        return
    opened = _Files(files)
    try:
        yield {key: _Slice(h.get_slice(key), key, opened) for h in opened.handles for key in h.keys()}
    finally:
        opened.close()

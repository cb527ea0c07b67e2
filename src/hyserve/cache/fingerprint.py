"""Which model, weights, dtype, tokenizer and chat template a disk checkpoint belongs to.

A state saved by one model must never be restored into another, nor a prompt rendered by one template
matched against a checkpoint taken under another. The fingerprint is stored in every disk file and a file
whose fingerprint differs is never used. Weight files are identified by name, size, mtime and their first
and last MiB (hashing gigabytes at every start would cost a minute); anything that changes a weight file
changes at least its mtime.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import transformers

from ..gguf import gguf_path, is_gguf, split_parts
from ..model_files import TOKENIZER_FILES, WEIGHT_GLOBS

FORMAT = "hyserve-disk-1"  # bump when the file layout or what a snapshot holds changes
_EDGE = 1 << 20


def _file_part(h, path: Path) -> None:
    st = path.stat()
    h.update(f"{path.name}|{st.st_size}|{st.st_mtime_ns}".encode())
    with open(path, "rb") as f:
        h.update(f.read(_EDGE))
        if st.st_size > 2 * _EDGE:
            f.seek(-_EDGE, 2)
            h.update(f.read(_EDGE))


def fingerprint(runtime, template: str) -> str:
    """A hex digest of the model (config, weights, dtype, quantization), tokenizer, chat template and transformers
    version, and of what computes the state: the device type and which of hyserve's kernels run (a state computed
    another way may differ in its last bits, and cache-on output must equal cache-off output exactly)."""
    h = hashlib.blake2b(digest_size=16)
    model = runtime.model
    dtype = next((p.dtype for p in model.parameters()), None)
    device = next((p.device.type for p in model.parameters()), "cpu")
    kernels = sorted(getattr(runtime.kernels, "status", {}).items())
    quantized = getattr(runtime, "quantization", None)  # its formats (the head's among them) and what it kept
    for part in (
        FORMAT,
        transformers.__version__,
        type(model).__name__,
        str(dtype),
        device,
        repr(kernels),
        quantized.describe() if quantized else "",
        template,
        model.config.to_json_string(use_diff=False),
    ):
        h.update(part.encode())
        h.update(b"\0")
    model_dir = Path(runtime.model_dir)
    if is_gguf(model_dir):  # one file (or the parts of a split one): weights, tokenizer and template
        for part in split_parts(gguf_path(model_dir)):
            _file_part(h, part)
        return h.hexdigest()
    files = sorted(
        {f for pattern in WEIGHT_GLOBS for f in model_dir.glob(pattern)}
        | {model_dir / name for name in TOKENIZER_FILES if (model_dir / name).is_file()}
    )
    for f in files:
        _file_part(h, f)
    return h.hexdigest()

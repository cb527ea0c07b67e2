"""GGUF files (llama.cpp, Ollama, LM Studio): find the file, check it before any weight is read, and load it.

Every architecture a module of `families` covers loads through hyserve's own loader (`loader`), which keeps
Q8_0 / Q4_0 weights quantized; only those whose model hyserve's families serve are accepted, so a file either loads
as the model it is or is refused at start with one line. The file is parsed once per load (`reader`).
"""

from __future__ import annotations

import importlib.util
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

SPLIT_PART = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$")
INSTALL_HINT = "pip install 'hyserve[gguf]'"


class GGUFError(ValueError):
    """A GGUF file hyserve cannot serve, worded for the person who passed it."""


@dataclass(frozen=True)
class GGUFInfo:
    path: Path
    architecture: str  # the file's `general.architecture`
    model_type: str  # the transformers model_type it loads as
    tensor_types: dict[str, int]  # GGML tensor type name -> tensor count, most frequent first
    has_chat_template: bool

    def describe(self) -> str:
        return ", ".join(f"{count} {name}" for name, count in self.tensor_types.items())


def is_gguf(path: str | Path) -> bool:
    """A .gguf file, or a folder without config.json holding .gguf files: what `gguf_path` resolves."""
    path = Path(path)
    if path.is_file():
        return path.suffix.lower() == ".gguf"
    return path.is_dir() and not (path / "config.json").exists() and any(path.glob("*.gguf"))


def gguf_path(path: str | Path) -> Path:
    """The one GGUF file `path` names (itself, or the folder's only one); for a split file (`-00001-of-00003`),
    its first part, once every part is found (`split_parts`)."""
    path = Path(path)
    if path.is_dir():
        files = sorted(path.glob("*.gguf"))
        stems = {f.name[: m.start()] for f in files if (m := SPLIT_PART.search(f.name))}
        if len(files) != 1 and not (len(stems) == 1 and all(SPLIT_PART.search(f.name) for f in files)):
            raise GGUFError(
                f"{path} holds {len(files)} GGUF files ({', '.join(f.name for f in files)}): pass the one to serve"
            )
        path = files[0]
    return split_parts(path)[0]


def split_parts(path: Path) -> list[Path]:
    """The files of the split `path` is a part of, first to last ([path] for a file not split). Raises
    GGUFError naming the parts that are missing."""
    m = SPLIT_PART.search(path.name)
    if m is None:
        return [path]
    count, stem = int(m.group(2)), path.name[: m.start()]
    parts = [path.with_name(f"{stem}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    if missing := [p.name for p in parts if not p.is_file()]:
        raise GGUFError(
            f"{path.name} is part of a GGUF split in {count} files, and {len(missing)} of them "
            f"{'is' if len(missing) == 1 else 'are'} missing: {', '.join(missing)} (all the parts "
            "must be in one folder)"
        )
    return parts


def supported_architectures() -> dict[str, str]:
    """GGUF architecture -> model_type, for those hyserve's loader (`architectures`) reads and hyserve serves."""
    from ..families import SUPPORTED_MODEL_TYPES
    from .architectures import model_types

    return {a: t for a, t in model_types().items() if t in SUPPORTED_MODEL_TYPES}


_readers: dict[tuple, object] = {}


def reader(path: Path):
    """A parsed `gguf.GGUFReader` of `path`, kept until the file changes or is loaded (`dispatch.load`), so that
    checking a file and loading it parse it once."""
    try:
        from gguf import GGUFReader
    except ImportError as exc:
        raise GGUFError(f"serving a GGUF file needs the gguf and accelerate packages: {INSTALL_HINT}") from exc
    if importlib.util.find_spec("accelerate") is None:  # the loader builds the model empty with it
        raise GGUFError(f"serving a GGUF file needs the accelerate package: {INSTALL_HINT}")
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _readers:
        _readers.clear()
        _readers[key] = GGUFReader(path, mode="c")  # (`readers`)
    return _readers[key]


def readers(path: Path) -> list:
    """Parsed readers of every part of `path` (one for a file not split), the first holding the metadata. The file is
    mapped copy-on-write: a weight held as the file's blocks is a view of the mapping (its pages the file's, read
    from disk once and shared with the page cache, as llama.cpp maps its files), never written."""
    first = reader(path)  # checks the packages are there
    from gguf import GGUFReader

    return [first] + [GGUFReader(p, mode="c") for p in split_parts(path)[1:]]


def inspect(path: str | Path) -> GGUFInfo:
    """Read and check the file's header: a GGUF at all, complete, of a supported architecture, with a
    tokenizer and tensor types gguf can dequantize. Raises GGUFError."""
    path = gguf_path(path)
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise GGUFError(f"{path} is not a GGUF file (it does not start with the GGUF magic)")
    parts = split_parts(path)
    for part in parts[1:]:
        with open(part, "rb") as f:
            if f.read(4) != b"GGUF":
                raise GGUFError(f"{part} is not a GGUF file (it does not start with the GGUF magic)")
    try:
        parsed = readers(path)
    except GGUFError:
        raise
    except Exception as exc:  # the parser's own errors on a cut or damaged file: struct, numpy, unicode, ...
        raise GGUFError(f"{path} is truncated or corrupt: {type(exc).__name__}: {exc}") from exc
    r = parsed[0]
    for part, pr in zip(parts, parsed):
        size = part.stat().st_size
        if any(int(t.data_offset) + int(t.n_bytes) > size for t in pr.tensors):
            raise GGUFError(f"{part} is truncated: its tensors need more bytes than the file's {size}")
    arch = _field(r, "general.architecture")
    supported = supported_architectures()
    if arch not in supported:
        raise GGUFError(f"{path.name}: GGUF architecture {arch!r} is not supported; supported: {', '.join(supported)}")
    if _field(r, "tokenizer.ggml.model") is None:
        raise GGUFError(f"{path.name} has no tokenizer in its metadata (tokenizer.ggml.*)")
    from gguf import GGMLQuantizationType
    from gguf.quants import _type_traits

    readable = {GGMLQuantizationType.F32, GGMLQuantizationType.F16, *_type_traits}
    types = Counter(t.tensor_type for pr in parsed for t in pr.tensors)
    if bad := sorted(t.name for t in types if t not in readable):
        raise GGUFError(f"{path.name}: tensor type(s) {', '.join(bad)} cannot be dequantized by gguf")
    return GGUFInfo(
        path,
        arch,
        supported[arch],
        {t.name: n for t, n in types.most_common()},
        _field(r, "tokenizer.chat_template") is not None,
    )


def _field(r, key: str):
    field = r.fields.get(key)
    return None if field is None else field.contents()

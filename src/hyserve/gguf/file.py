"""GGUF files (llama.cpp, Ollama, LM Studio): find the file, check it before any weight is read, and load it.

The architectures a module of `families` covers (the hybrid ones) load through hyserve's own loader (`loader`),
which keeps Q8_0 / Q4_0 weights quantized. The others load through transformers' GGUF loader, which builds the
config, tokenizer and chat template from the file's metadata and dequantizes every tensor to float. Only
architectures one of the two reads and hyserve's families serve are accepted, so a file either loads as the
model it is or is refused at start with one line. The file is parsed once per load (`parsed_once`).
"""

from __future__ import annotations

import contextlib
import functools
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
    """GGUF architecture -> model_type, for those hyserve's loader (`architectures`) or transformers' reads and
    hyserve serves."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    from ..families import SUPPORTED_MODEL_TYPES
    from .architectures import model_types

    ours = {a: t for a, t in model_types().items() if t in SUPPORTED_MODEL_TYPES}
    return {**{a: a for a in GGUF_SUPPORTED_ARCHITECTURES if a in SUPPORTED_MODEL_TYPES}, **ours}


def hyserve_loads(arch: str) -> bool:
    """Whether hyserve's own loader (`loader`) reads this architecture, not transformers'."""
    from .architectures import module_for

    return module_for(arch) is not None


_readers: dict[tuple, object] = {}


def reader(path: Path):
    """A parsed `gguf.GGUFReader` of `path`, kept until the file changes (see `parsed_once`)."""
    try:
        from gguf import GGUFReader
    except ImportError as exc:
        raise GGUFError(f"serving a GGUF file needs the gguf and accelerate packages: {INSTALL_HINT}") from exc
    if importlib.util.find_spec("accelerate") is None:  # transformers' GGUF loader refuses to run without it
        raise GGUFError(f"serving a GGUF file needs the accelerate package: {INSTALL_HINT}")
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _readers:
        _readers.clear()
        _readers[key] = GGUFReader(path)
    return _readers[key]


def readers(path: Path) -> list:
    """Parsed readers of every part of `path` (one for a file not split), the first holding the metadata."""
    first = reader(path)  # checks the packages are there
    from gguf import GGUFReader

    return [first] + [GGUFReader(p) for p in split_parts(path)[1:]]


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
    # as transformers' loader reads it: a llama file named exactly "mistral" loads as Mistral (not served)
    model_type = "mistral" if "llama" in arch and _field(r, "general.name") == "mistral" else arch
    supported = supported_architectures()
    model_type = supported.get(model_type, model_type)
    if model_type not in supported.values():
        raise GGUFError(
            f"{path.name}: GGUF architecture {model_type!r} is not supported; supported: {', '.join(supported)}"
        )
    if len(parts) > 1 and not hyserve_loads(arch):
        raise GGUFError(
            f"{path.name} is part 1 of a GGUF split in {len(parts)} files, which transformers' loader "
            f"(the one for {arch}) cannot read: merge them first (llama.cpp's `llama-gguf-split --merge`)"
        )
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
        model_type,
        {t.name: n for t, n in types.most_common()},
        _field(r, "tokenizer.chat_template") is not None,
    )


def _field(r, key: str):
    field = r.fields.get(key)
    return None if field is None else field.contents()


@contextlib.contextmanager
def parsed_once(path: Path):
    """Within: transformers' GGUF loader reuses what it (or `inspect`) already parsed of `path`: the reader, the
    metadata it reads for the config and again for the tokenizer, and gguf's tensor-name map, which it builds
    anew for every module of the model (most of the load time of a small model otherwise)."""
    import copy

    import gguf
    import transformers.modeling_gguf_pytorch_utils as hf_gguf

    parsed, metadata = reader(path), {}
    patched = {
        (gguf, "GGUFReader"): gguf.GGUFReader,
        (gguf, "get_tensor_name_map"): gguf.get_tensor_name_map,
        (hf_gguf, "load_gguf_checkpoint"): hf_gguf.load_gguf_checkpoint,
        (hf_gguf, "tqdm"): hf_gguf.tqdm,
    }
    same = functools.partial(_same_file, path)

    def read(p, *args, **kwargs):
        return parsed if same(p) and not args and not kwargs else patched[gguf, "GGUFReader"](p, *args, **kwargs)

    def checkpoint(p, return_tensors=False, **kwargs):
        load = patched[hf_gguf, "load_gguf_checkpoint"]
        if return_tensors or kwargs or not same(p):
            return load(p, return_tensors=return_tensors, **kwargs)
        if not metadata:
            metadata.update(load(p))
            arch = _field(parsed, "general.architecture")
            if (head_dim := _field(parsed, f"{arch}.attention.key_length")) is not None:  # transformers skips it:
                metadata["config"].setdefault("head_dim", int(head_dim))  # Qwen3's default (128) would be wrong
        return copy.deepcopy(metadata)  # the callers may edit what they get

    gguf.GGUFReader, hf_gguf.load_gguf_checkpoint = read, checkpoint
    gguf.get_tensor_name_map = functools.cache(gguf.get_tensor_name_map)
    hf_gguf.tqdm = lambda items, **_: items  # its progress bar, which ignores transformers' own switch; we log
    try:
        yield
    finally:
        for (module, name), original in patched.items():
            setattr(module, name, original)
        _readers.clear()  # its parsed metadata is not needed once loaded


def _same_file(path: Path, other) -> bool:
    try:
        return Path(other).resolve() == path.resolve()
    except (TypeError, OSError):
        return False

"""A snapshot's cache as plain tensors plus a JSON layout, and back: what the disk tier writes and reads.

No pickle: a file in the cache directory is data, never code. The layout names each layer's class and its
attributes (tensors by key, dicts, plain values, dtypes, devices); loading fills a fresh cache built from
the model's config and refuses (ValueError) any file whose layer classes or attribute kinds do not fit it.
"""

from __future__ import annotations

import hashlib
import hmac
import json

import torch

_SCALARS = (bool, int, float, str)


def _encode(value, key: str, tensors: dict[str, torch.Tensor]):
    if isinstance(value, torch.Tensor):
        tensors[key] = value
        return {"t": key}
    if value is None or isinstance(value, _SCALARS):
        return {"v": value}
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, torch.device):
        return {"device": str(value)}
    if isinstance(value, dict):
        items = []
        for i, (k, v) in enumerate(value.items()):
            if not (k is None or isinstance(k, _SCALARS)):
                raise TypeError(f"dict key {type(k).__name__} at {key}")
            items.append([k, _encode(v, f"{key}.{i}", tensors)])
        return {"dict": items}
    raise TypeError(f"{type(value).__name__} at {key}")


def _decode(enc: dict, tensors: dict[str, torch.Tensor], device):
    if "t" in enc:
        return tensors[enc["t"]].to(device)
    if "v" in enc:
        return enc["v"]
    if "dtype" in enc:
        dtype = getattr(torch, enc["dtype"], None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"unknown dtype {enc['dtype']!r}")
        return dtype
    if "device" in enc:
        return torch.device(device)  # where this process runs the model, not where the writer did
    if "dict" in enc:
        return {k: _decode(v, tensors, device) for k, v in enc["dict"]}
    raise ValueError(f"unknown layout entry {sorted(enc)}")


def to_tensors(cache) -> tuple[dict[str, torch.Tensor], str]:
    """(tensors by key, layout JSON) for a cache's layers. Raises TypeError for an attribute it cannot say."""
    tensors: dict[str, torch.Tensor] = {}
    layout = [
        {
            "class": type(layer).__name__,
            "attrs": {name: _encode(v, f"{i}.{name}", tensors) for name, v in vars(layer).items()},
        }
        for i, layer in enumerate(cache.layers)
    ]
    return tensors, json.dumps(layout, separators=(",", ":"))


def from_tensors(fresh_cache, tensors: dict[str, torch.Tensor], layout_json: str, device) -> object:
    """Fill `fresh_cache` (the model's empty cache) from `to_tensors`' output; ValueError if it does not fit."""
    layout = json.loads(layout_json)
    if not isinstance(layout, list) or len(layout) != len(fresh_cache.layers):
        raise ValueError("layer count differs from the model's")
    for layer, entry in zip(fresh_cache.layers, layout):
        if entry.get("class") != type(layer).__name__:
            raise ValueError(f"layer class {entry.get('class')!r} is not the model's {type(layer).__name__!r}")
        for name, enc in entry["attrs"].items():
            setattr(layer, name, _decode(enc, tensors, device))
    return fresh_cache


def checksum(tensors: dict[str, torch.Tensor], *texts: str, key: bytes | None = None) -> str:
    """blake2b over every tensor's key, dtype, shape and bytes (in key order) and the given texts; with `key`,
    an HMAC-SHA256 of the same, which only a holder of the key can make."""
    h = hmac.new(key, digestmod=hashlib.sha256) if key is not None else hashlib.blake2b(digest_size=16)
    for text in texts:
        h.update(text.encode())
        h.update(b"\0")
    for key in sorted(tensors):
        t = tensors[key].detach().to("cpu").contiguous()
        h.update(f"{key}|{t.dtype}|{tuple(t.shape)}".encode())
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()

"""GGUF files for tests, written with the `gguf` package's writer (llama.cpp's own): a tiny HF qwen3/llama folder
converted as llama.cpp's converter would (metadata keys, tensor names, a gpt2-type tokenizer), unquantized or
with chosen tensors in Q8_0, and arbitrary headers for the bad-input checks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

ARCHES = {"qwen3": "QWEN3", "qwen2": "QWEN2", "llama": "LLAMA"}


def write_from_folder(model_dir: Path, out: Path, quantize: str | None = None) -> Path:
    """`model_dir` (a tiny qwen3/qwen2/llama from `make-tiny-model`) as one GGUF file at `out`. `quantize`:
    "Q8_0" stores the 2-D projection weights in Q8_0 (norms and embeddings stay F32), as llama.cpp does."""
    import gguf
    from safetensors.numpy import load_file

    cfg = json.loads((model_dir / "config.json").read_text())
    arch = cfg["model_type"]
    w = gguf.GGUFWriter(out, arch)
    n_layers = cfg["num_hidden_layers"]
    w.add_block_count(n_layers)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    if "head_dim" in cfg:
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
    _add_tokenizer(w, model_dir, arch)
    names = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, ARCHES[arch]), n_layers)
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    for hf_name, data in load_file(model_dir / "model.safetensors").items():
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert name is not None, hf_name
        data = data.astype(np.float32)
        if arch == "llama" and hf_name.endswith(("q_proj.weight", "k_proj.weight")):  # llama.cpp's rope layout
            data = _permute(data, heads if "q_proj" in hf_name else kv_heads)
        if quantize == "Q8_0" and data.ndim == 2 and "embed" not in hf_name and data.shape[1] % 32 == 0:
            qtype = gguf.GGMLQuantizationType.Q8_0
            w.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """What convert_hf_to_gguf.py's LlamaModel.permute does (hyserve's loader undoes it: gguf/families/attention.py)."""
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def _add_tokenizer(w, model_dir: Path, arch: str) -> None:
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    tcfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    vocab = dict(tok["model"]["vocab"])
    specials = {t["content"] for t in tok["added_tokens"] if t["special"]}
    for t in tok["added_tokens"]:
        vocab[t["content"]] = t["id"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2" if arch.startswith("qwen") else "default")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in specials else 1 for t in tokens])  # 3: control, 1: normal
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in tok["model"]["merges"]])
    ids = {t["content"]: t["id"] for t in tok["added_tokens"]}
    if (eos := tcfg.get("eos_token")) in ids:
        w.add_eos_token_id(ids[eos])
    if (pad := tcfg.get("pad_token")) in ids:
        w.add_pad_token_id(ids[pad])
    if (bos := tcfg.get("bos_token")) in ids:
        w.add_bos_token_id(ids[bos])
    template = tcfg.get("chat_template")
    if template is None and (model_dir / "chat_template.jinja").is_file():
        template = (model_dir / "chat_template.jinja").read_text()
    if template:
        w.add_chat_template(template)


def write_header_only(out: Path, arch: str, tokenizer: bool = True, raw=None) -> Path:
    """A GGUF with metadata and one small F32 tensor, of any architecture name (for the refusal checks);
    `raw`: (bytes as a uint8 array, ggml type, shape) of that tensor instead."""
    import gguf

    w = gguf.GGUFWriter(out, arch)
    w.add_block_count(1)
    if tokenizer:
        w.add_tokenizer_model("gpt2")
        w.add_token_list(["a", "b"])
    if raw is not None:
        w.add_tensor("token_embd.weight", raw[0], raw_shape=raw[2], raw_dtype=raw[1])
    else:
        w.add_tensor("token_embd.weight", np.zeros((2, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def requantize(
    src: Path,
    out: Path,
    qtype_of,
    split_max_tensors: int = 0,
    meta: dict | None = None,
    extra: dict | None = None,
    reverse: bool = False,
) -> Path:
    """`src` (an F32 file, e.g. from llama.cpp's converter) rewritten with the same metadata, each tensor in
    `qtype_of(name, shape)` (a `gguf.GGMLQuantizationType`, quantized by gguf's reference quantizers, K-quants by
    `kquantize`) or F32
    where that is None. `split_max_tensors`: written as a split (`out`-0000i-of-0000n.gguf, as llama.cpp's
    gguf-split names the parts) of that many tensors a part; the first part's path is returned. `meta`: key ->
    new value of existing metadata fields (same type) or new uint32 ones; `extra`: name -> F32 array, tensors
    added; `reverse`: the tensors written last to first (a file whose up_exps come before its gate_exps)."""
    import gguf

    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(out, r.fields["general.architecture"].contents(), split_max_tensors=split_max_tensors)
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vtype = field.types[0]
        w.add_key_value(
            key,
            (meta or {}).get(key, field.contents()),
            vtype,
            sub_type=field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None,
        )
    for key, value in (meta or {}).items():
        if key not in r.fields:
            w.add_key_value(key, value, gguf.GGUFValueType.UINT32)
    for t in reversed(r.tensors) if reverse else r.tensors:
        data = np.array(t.data, dtype=np.float32)
        if (qtype := qtype_of(t.name, data.shape)) is not None and qtype.name in ("Q4_K", "Q5_K", "Q6_K"):
            w.add_tensor(t.name, kquantize(data.reshape(-1, data.shape[-1]), qtype.name), raw_dtype=qtype)
        elif qtype is not None:
            w.add_tensor(t.name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(t.name, data)
    for name, data in (extra or {}).items():
        w.add_tensor(name, data)
    w.write_header_to_file(out)
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out if not split_max_tensors else out.with_name(f"{out.stem}-00001-of-{len(w.tensors):05d}.gguf")


def convert(converter: Path, model_dir: Path, out: Path, outtype: str, *extra: str) -> Path:
    """`model_dir` written to `out` by llama.cpp's convert_hf_to_gguf.py in the folder `converter` (the test fails
    with the converter's stderr when it does)."""
    args = [
        sys.executable,
        "convert_hf_to_gguf.py",
        str(model_dir),
        "--outtype",
        outtype,
        *extra,
        "--outfile",
        str(out),
    ]
    r = subprocess.run(args, cwd=converter, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and out.is_file(), r.stderr[-2000:]
    return out


def converted_once(converter: Path, folders, tmp_path_factory):
    """(arch, outtype="f32") -> the folder `folders(arch)` converted by llama.cpp's converter, once per
    (arch, outtype): the body of the test modules' `converted` fixtures."""
    done = {}

    def get(arch, outtype="f32"):
        if (arch, outtype) not in done:
            out = tmp_path_factory.mktemp("gguf") / f"{arch}-{outtype}.gguf"
            done[arch, outtype] = convert(converter, folders(arch), out, outtype)
        return done[arch, outtype]

    return get


def kquantize(data: np.ndarray, kind: str) -> np.ndarray:
    """`data` [n, k] (k a multiple of 256) as Q4_K, Q5_K or Q6_K blocks (uint8 [n, k / 256 * block bytes]): a plain
    min/max quantizer (gguf-py has none for these types; llama-quantize searches its scales better), whose blocks
    are laid out as ggml's, so that gguf-py's `dequantize` reads them back close to `data`."""
    n, k = data.shape
    x = data.astype(np.float32).reshape(n * k // 256, 8, 32)
    nb = x.shape[0]
    f16 = lambda v: v.astype(np.float16)  # noqa: E731
    if kind == "Q6_K":
        g = x.reshape(nb, 16, 16)
        s = np.abs(g).max(-1) / 31
        d = f16(np.abs(s).max(-1) / 127)
        dd = d.astype(np.float32)[:, None]
        sc = np.clip(np.round(np.divide(s, dd, out=np.zeros_like(s), where=dd > 0)), -128, 127).astype(np.int8)
        step = dd * sc
        q = np.clip(np.round(np.divide(g, step[..., None], out=np.zeros_like(g), where=step[..., None] != 0)), -32, 31)
        u = (q + 32).astype(np.uint8).reshape(nb, 2, 4, 32)  # sub-block 4h + t
        ql = np.zeros((nb, 2, 64), np.uint8)
        qh = np.zeros((nb, 2, 32), np.uint8)
        for t in range(4):
            half = slice(32 * (t & 1), 32 * (t & 1) + 32)
            ql[:, :, half] |= (u[:, :, t] & 15) << (4 if t >= 2 else 0)
            qh |= (u[:, :, t] >> 4) << (2 * t)
        out = np.concatenate([ql.reshape(nb, 128), qh.reshape(nb, 64), sc.view(np.uint8), d[:, None].view(np.uint8)], 1)
        return out.reshape(n, -1)
    top = 15 if kind == "Q4_K" else 31
    lo, hi = np.minimum(x.min(-1), 0), np.maximum(x.max(-1), 0)
    s, m = (hi - lo) / top, -lo
    d, dmin = f16(s.max(-1) / 63), f16(m.max(-1) / 63)
    dd, dm = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    sc = np.clip(np.round(np.divide(s, dd, out=np.zeros_like(s), where=dd > 0)), 0, 63).astype(np.uint8)
    mq = np.clip(np.round(np.divide(m, dm, out=np.zeros_like(m), where=dm > 0)), 0, 63).astype(np.uint8)
    step = (dd * sc)[..., None]
    u = np.clip(np.round(np.divide(x + (dm * mq)[..., None], step, out=np.zeros_like(x), where=step > 0)), 0, top)
    u = u.astype(np.uint8)  # [nb, 8, 32]
    scales = np.zeros((nb, 12), np.uint8)
    scales[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    scales[:, 4:8] = (mq[:, :4] & 63) | ((mq[:, 4:] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:] & 15) | ((mq[:, 4:] & 15) << 4)
    qs = ((u[:, 0::2] & 15) | ((u[:, 1::2] & 15) << 4)).reshape(nb, 128)
    parts = [d[:, None].view(np.uint8), dmin[:, None].view(np.uint8), scales]
    if kind == "Q5_K":
        parts.append(np.bitwise_or.reduce((u >> 4) << np.arange(8, dtype=np.uint8)[None, :, None], axis=1))
    return np.concatenate([*parts, qs], 1).reshape(n, -1)

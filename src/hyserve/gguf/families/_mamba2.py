"""The Mamba2 mixer as llama.cpp's converter writes it (conversion/mamba.py: Mamba2Model, and the same steps in
NemotronHModel's MoE path), back to the HF tensors every Mamba2 hybrid shares (`in_proj`, `conv1d`, `dt_bias`,
`A_log`, `D`, `norm`, `out_proj`). Not a family module: the registry skips it."""

from __future__ import annotations

import torch

from ._common import required

# GGUF name within a block -> the HF name within the mixer
NAMES = {
    "ssm_in.weight": "in_proj.weight",
    "ssm_in.bias": "in_proj.bias",
    "ssm_conv1d.weight": "conv1d.weight",
    "ssm_conv1d.bias": "conv1d.bias",
    "ssm_dt.bias": "dt_bias",  # the converter renamed dt_bias to dt_proj.bias / dt.bias to map it
    "ssm_a": "A_log",
    "ssm_d": "D",
    "ssm_norm.weight": "norm.weight",
    "ssm_out.weight": "out_proj.weight",
    "ssm_out.bias": "out_proj.bias",
}


def dims(meta: dict) -> dict:
    """The mixer's sizes from the file's `ssm.*` keys (time_step_rank holds the head count for Mamba2)."""
    inner, heads = int(required(meta, "ssm.inner_size")), int(required(meta, "ssm.time_step_rank"))
    return {
        "inner": inner,
        "heads": heads,
        "head_dim": inner // heads,
        "state": int(required(meta, "ssm.state_size")),
        "groups": int(required(meta, "ssm.group_count")),
        "conv": int(required(meta, "ssm.conv_kernel")),
    }


def mamba_sizes(ssm: dict) -> dict:
    """The mixer's sizes (`dims`) under the config keys Bamba, GraniteMoeHybrid and Falcon-H1 share."""
    return {
        "mamba_n_heads": ssm["heads"],
        "mamba_d_head": ssm["head_dim"],
        "mamba_d_state": ssm["state"],
        "mamba_n_groups": ssm["groups"],
        "mamba_d_conv": ssm["conv"],
    }


def mixer_tensor(rest: str, array: torch.Tensor) -> tuple[str, torch.Tensor] | None:
    """One GGUF mixer tensor (`rest`: its name within the block) -> (HF name within the mixer, tensor), or None
    for a tensor that is not the mixer's."""
    hf = NAMES.get(rest)
    if hf is None:
        return None
    if rest == "ssm_a":  # A_log -> A = -exp(A_log), stored (heads, 1)
        array = torch.log(-array.reshape(-1))
    elif rest == "ssm_d":  # stored (heads, 1)
        array = array.reshape(-1)
    elif rest == "ssm_conv1d.weight":  # HF (channels, 1, kernel), squeezed to (channels, kernel)
        array = array.unsqueeze(1)
    elif rest == "ssm_norm.weight":  # the gated norm's weight, reshaped into (groups, inner / groups)
        array = array.reshape(-1)
    return hf, array

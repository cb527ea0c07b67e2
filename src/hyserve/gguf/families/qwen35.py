"""Qwen3.5 (`qwen35`) and Qwen3-Next (`qwen3next`) GGUF files, as llama.cpp's converter writes them
(conversion/qwen.py: Qwen3_5TextModel, Qwen3NextModel), back to the HF checkpoint."""

from __future__ import annotations

ARCHITECTURES = {"qwen35": "qwen3_5_text", "qwen3next": "qwen3_next"}


def config(meta: dict) -> dict:
    raise NotImplementedError


def tensors(name: str, array, meta: dict, cfg: dict) -> list:
    raise NotImplementedError

"""The settings hyserve's commands give their own process at start (`apply`), never on import: a program that
imports hyserve as a library keeps its environment as it was (tests/test_process_settings.py checks it).

Each entry point calls `apply()` first, before anything imports torch: PyTorch reads THP_MEM_ALLOC_ENABLE once,
at its first CPU allocation (importing torch may already allocate), so the huge-pages request
(`allocator.request_huge_pages`) only counts when it comes before. Child processes (uvicorn workers, Ray
replicas started by the command) inherit the environment.
"""

from __future__ import annotations

import os

from .allocator import request_huge_pages

# Weights, tokenizers and templates come only from the local folder: never a hub download or version check
# (a server on an offline host would otherwise wait on timeouts); an explicit setting is kept.
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1"}


def apply() -> None:
    """Set up this process as hyserve's commands run: huge pages for PyTorch's large CPU allocations (unless
    HYSERVE_HUGE_PAGES=0), and transformers offline (unless set otherwise). Call before importing torch."""
    request_huge_pages()
    for name, value in OFFLINE.items():
        os.environ.setdefault(name, value)

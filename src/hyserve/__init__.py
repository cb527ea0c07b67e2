"""hyserve: an OpenAI-compatible server for hybrid recurrent/attention models with an exact-state prefix cache."""

from .allocator import request_huge_pages as _request_huge_pages

__version__ = "0.1.0"

_request_huge_pages()  # before anything imports torch: PyTorch reads the setting at its first allocation

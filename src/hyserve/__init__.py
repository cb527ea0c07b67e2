"""hyserve: an OpenAI-compatible server for hybrid recurrent/attention models with an exact-state prefix cache."""

from .openmp import wait_actively

__version__ = "0.1.0"

wait_actively()  # before anything imports torch: see hyserve.openmp

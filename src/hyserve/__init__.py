"""hyserve: an OpenAI-compatible server for hybrid recurrent/attention models with an exact-state prefix cache."""

__version__ = "0.1.0"
